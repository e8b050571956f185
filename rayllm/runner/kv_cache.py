"""KV cache sizing and allocation: one tensor per rank, viewed per layer in the attention backend's layout."""

from __future__ import annotations

import gc
import math
import mmap

import torch


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    return max(0, budget_bytes // per_block)


def require_blocks(num_blocks: int, config) -> int:
    """Fail at start, naming the knobs, rather than run with no KV cache (0 blocks divide by zero later)."""
    if num_blocks < 2:
        cache = config.cache
        where = (f"gpu_memory_utilization {cache.gpu_memory_utilization} of the GPU (is another replica or "
                 "process using it?)" if config.parallel.device == "cuda" else f"kv_cache_bytes {cache.kv_cache_bytes}")
        raise RuntimeError(f"the KV cache budget holds {num_blocks} blocks (at least 2 needed): {where} leaves "
                           "too little memory once the model is loaded")
    return num_blocks


def cuda_budget(utilization: float, device: torch.device, activation_bytes: int) -> int:
    """Bytes for KV: `utilization` of the GPU is this instance's share (as vLLM's gpu_memory_utilization),
    less what this process already holds (its weights and buffers) and the largest step's activations; and
    never more than is free now (other processes keep what they use, and are not charged to this share).
    The allocator's cached blocks are released first, so they do not count as used."""
    gc.collect()  # tensors of an engine this process dropped may wait in reference cycles
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_allocated(device)
    return int(min(total * utilization - own, free) - activation_bytes)


def profile_step(max_tokens: int, max_seqs: int, block_size: int):
    """The largest step the scheduler can form: max_tokens prompt tokens over max_seqs sequences, each
    sampling (so the LM head runs for every one), on disjoint blocks; returns it and the blocks used."""
    from rayllm.schema.step import SeqStep, StepInput

    seqs, first_block = [], 0
    n = min(max_seqs, max_tokens)
    for i in range(n):
        length = max_tokens // n + (1 if i < max_tokens % n else 0)
        blocks = -(-length // block_size)
        table = list(range(first_block, first_block + blocks))
        seqs.append(SeqStep(f"profile-{i}", [0] * length, 0, table, sample=True))
        first_block += blocks
    return StepInput(seqs), first_block


def allocate(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device,
    layout: str = "head_major",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """head_major [Hk, blocks, block_size, D] (CPU): each head's blocks are contiguous [block_size, D]
    rows, so decode attention gathers every sequence's context for all heads with one index_select
    (attention.decode_attention). block_major [blocks, block_size, Hk, D] (xformers): the key layout
    its paged attention biases read in place."""
    if layout == "head_major":
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
    elif layout == "block_major":
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    else:
        raise ValueError(f"unknown KV cache layout {layout!r}")
    cache = _zeros_untouched(shape, dtype) if torch.device(device).type == "cpu" else torch.zeros(
        shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]


def _zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """CPU: zeros in an anonymous mapping, which the OS hands out zero-filled page by page as they are first
    written, instead of torch.zeros writing every byte at start: a 1 GiB cache costs no start-up time (the
    zero-fill moves to each page's first write, about as much CPU in all) and no memory until its blocks are
    used. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
