"""What every attention backend shares: the step's metadata, built once per step by the model runner and read
by every layer, the paged cache writes, and the interface a backend implements (`AttentionBackend`).

The model runner lays a step's tokens out flat, decode tokens first, then each prefill chunk. New keys and
values are written into the paged cache by slot, then each query attends to its sequence's cached context.
A backend is a file in this folder plus one line in selector.BACKENDS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class AttentionBackend(Protocol):
    """An attention implementation over the paged KV cache, one instance per worker, shared by its layers."""

    name: str
    # "head_major": [Hk, num_blocks, block_size, D]; "block_major": [num_blocks, block_size, Hk, D].
    cache_layout: str
    # Fused kernels the model's layers may call (norm, rotary, SiLU; the PagedKernels interface) or None;
    # with them the runner builds the per-sequence block tables they read instead of torch masks.
    kernels: Any
    # The runner also lists every context slot of the step (a gathered varlen fallback reads them).
    needs_context_slots: bool
    # Runs sliding-window and soft-capped layers itself (else such models take the torch metadata).
    windows_and_softcap: bool
    # Decode steps may replay CUDA graphs (False once the backend fell back to a path that reads host lists).
    paged_decode: bool

    def probe(self, device: torch.device) -> None:
        """Raise unless the backend runs on `device` (called once at start-up, before it is chosen)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, *, scale: float | None = None,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]; writes k, v into the caches, returns [T, Hq * D]."""


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk in the flat token layout
    q_len: int
    ctx_len: int  # context keys, this chunk included, from the first block not freed (block_manager.FREED)
    slots: torch.Tensor | None  # cache slots of the whole context; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal shifted by the cached prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode: int
    block_size: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] each decode sequence's blocks (padded)
    decode_mask: torch.Tensor | None  # [B, max_blocks * block_size] bool: position < context length
    # [Hk * B * max_blocks] rows of the cache viewed as [Hk * num_blocks, block_size, D], head-major:
    # one index_select gathers every decode sequence's context for all heads.
    decode_gather_index: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # For varlen backends: per-sequence query and context lengths in flat order, and all context slots.
    q_lens: list[int] = field(default_factory=list)
    ctx_lens: list[int] = field(default_factory=list)
    ctx_slots: torch.Tensor | None = None
    # For the C kernel (cpu_kernels.paged_attention), every sequence of the step in flat order, int32:
    # block tables [S, max_blocks] (padded), context lengths, first query row and query rows.
    seq_block_tables: torch.Tensor | None = None
    seq_ctx_lens: torch.Tensor | None = None
    seq_q_starts: torch.Tensor | None = None
    seq_q_lens: torch.Tensor | None = None
    # Built once per step from the fields above (windowed layers' masks, xformers' biases) by the first
    # layer that needs them, and reused by the rest.
    derived: dict = field(default_factory=dict)


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache: [Hk, num_blocks, block_size, D]; slot = block * block_size + offset; values: [T, Hk, D]."""
    bs = cache.shape[2]
    cache[:, slots // bs, slots % bs] = values.transpose(0, 1)


def write_cache_block_major(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache: [num_blocks, block_size, Hk, D] (the xformers layout); values: [T, Hk, D]."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, values)


def decode_gather_index(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids into a head-major cache viewed as [Hk * num_blocks, block_size, D], ordered [Hk, B, nb]."""
    heads = torch.arange(num_kv_heads, device=block_tables.device).unsqueeze(1) * num_blocks
    return (heads + block_tables.flatten().unsqueeze(0)).flatten()
