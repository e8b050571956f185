"""What every attention backend shares: the step's metadata, built once per step by the model runner and read
by every layer, the paged cache writes, and the interface a backend implements (`AttentionBackend`).

The model runner lays a step's tokens out flat, decode tokens first, then each prefill chunk. New keys and
values are written into the paged cache by slot, then each query attends to its sequence's cached context.
A backend is a file in this folder plus one line in registry.BACKENDS; it owns how its metadata is built
(`metadata_builder`: an `AttentionMetadataBuilder`, below).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class AttentionBackend(Protocol):
    """An attention implementation over the paged KV cache, one instance per worker, shared by its layers."""

    name: str
    # "head_major": [Hk, num_blocks, block_size, D]; "block_major": [num_blocks, block_size, Hk, D].
    cache_layout: str
    # Fused kernels the model's layers may call (norm, rotary, SiLU; the PagedKernels interface) or None.
    kernels: Any
    # Decode steps may replay CUDA graphs (False once the backend fell back to a path that reads host lists).
    paged_decode: bool

    def probe(self, device: torch.device, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> None:
        """Raise unless the backend runs on `device` at the model's head dim and dtype (called once at
        start-up, before it is chosen)."""

    def metadata_builder(self, block_size: int, kv_caches: list, torch_attention_only: bool) -> AttentionMetadataBuilder:
        """How the runner (and the decode CUDA graphs) build this backend's metadata over `kv_caches`;
        torch_attention_only: the model has sliding-window or soft-capped layers."""

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


class AttentionMetadataBuilder:
    """How a backend's metadata is built: one per model runner, chosen by the backend (`metadata_builder`),
    used by the runner's eager steps (`step`) and by the decode CUDA graphs (`decode_graph`) alike.

    It builds what its backend reads, in one of two forms:
    - per sequence (`seq_tables`): every sequence's block table, context length, first query row and query
      rows, int32, for kernels that walk the paged cache themselves (the C and Triton kernels, xformers'
      paged biases); with `context_slots`, also every context slot of the step (xformers' varlen fallback);
    - the torch path's (neither): the decode rows' mask and gather index over a head-major cache, and each
      prefill chunk's context slots and causal mask.
    """

    def __init__(self, block_size: int, kv_caches, seq_tables: bool = False, context_slots: bool = False,
                 kernels: bool = False) -> None:
        """kv_caches: the runner's [(k, v)] per layer (the torch path's gather index is over their blocks);
        kernels: the per-sequence inputs feed the backend's fused kernels (what half steps need)."""
        self.block_size = block_size
        self.seq_tables = seq_tables or context_slots
        self.context_slots = context_slots
        self.kernels = kernels
        # Head-major caches: (KV heads, blocks), the rows of the torch decode path's gather index.
        self.cache_rows = tuple(kv_caches[0][0].shape[:2]) if kv_caches else (0, 0)

    def step(self) -> StepMetadata:
        """An empty step: the runner adds each sequence in flat order, uploads, then builds."""
        return StepMetadata(self)

    def decode_graph(self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, q_starts: torch.Tensor,
                     num_blocks: int) -> AttentionMetadata:
        """Fixed-shape metadata of `size` decode rows over static buffers (runner/cuda_graphs.py), derived on the
        device inside the graph: tables [size, width] (stale entries past a row's length are masked by `lens`)."""
        size, width = tables.shape
        bs, device = self.block_size, tables.device
        # Python-side lengths are upper bounds: the kernels read `lens`.
        common = dict(slot_mapping=slots, num_decode=size, block_size=bs, q_lens=[1] * size,
                      ctx_lens=[width * bs] * size)
        if self.seq_tables:
            return AttentionMetadata(**common, decode_mask=None, seq_block_tables=tables, seq_ctx_lens=lens,
                                     seq_q_starts=q_starts, seq_q_lens=torch.ones(size, dtype=torch.int32, device=device))
        return AttentionMetadata(
            **common, decode_mask=torch.arange(width * bs, device=device).unsqueeze(0) < lens.unsqueeze(1),
            decode_gather_index=decode_gather_index(tables, self.cache_rows[0], num_blocks))


class StepMetadata:
    """One eager step's metadata in the making: host lists per sequence, one upload, then tensors."""

    def __init__(self, builder: AttentionMetadataBuilder) -> None:
        self.b = builder
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.chunks: list[tuple[int, int, int, list[int]]] = []  # prefill: q_start, q_len, ctx_len, blocks
        self.q_lens: list[int] = []
        self.ctx_lens: list[int] = []
        self.seq_tables: list[list[int]] = []
        self.ctx_blocks: list[list[int]] = []
        self.q_starts: list[int] = []

    def add(self, q_start: int, n: int, block_table: list[int], end: int) -> None:
        """A sequence whose `n` new tokens start at flat row `q_start` and end at position `end`."""
        bs = self.b.block_size
        self.q_lens.append(n)
        blocks = block_table[: -(-end // bs)]
        # Blocks behind every layer's window were freed (block_manager.FREED): the context is gathered
        # from the first live block on; every mask is relative to the context's end, so none changes.
        dropped = bisect.bisect_left(blocks, True, key=lambda b: b >= 0) if blocks[0] < 0 else 0
        blocks = blocks[dropped:]
        ctx = end - dropped * bs
        self.ctx_lens.append(ctx)
        self.ctx_blocks.append(blocks)
        is_decode = n == 1 and not self.chunks and len(self.decode_lens) == len(self.q_lens) - 1
        if self.b.seq_tables:
            self.seq_tables.append(blocks)
            self.q_starts.append(q_start)
            if is_decode:
                self.decode_lens.append(ctx)
        elif is_decode:
            self.decode_tables.append(blocks)
            self.decode_lens.append(ctx)
        else:
            self.chunks.append((q_start, n, ctx, blocks))

    def host_lists(self) -> list[list[int]]:
        """The integer lists to upload (input_buffers.py), in the order `build` reads them back."""
        parts: list[list[int]] = []
        if self.decode_tables:
            width = max(len(t) for t in self.decode_tables)
            parts += [[b for t in self.decode_tables for b in t + [0] * (width - len(t))], self.decode_lens]
        if self.seq_tables:
            width = max(len(t) for t in self.seq_tables)
            parts += [[b for t in self.seq_tables for b in t + [0] * (width - len(t))], self.ctx_lens, self.q_starts,
                      self.q_lens]
        parts += [c[3] for c in self.chunks if c[1] != c[2]]  # blocks of chunks after a cached prefix
        if self.b.context_slots:
            parts += self.ctx_blocks
        return parts

    def build(self, slots_t: torch.Tensor, tensors: Iterator[torch.Tensor]) -> AttentionMetadata:
        """The metadata from the uploaded lists (`tensors`, in host_lists' order) and the new tokens' slots."""
        bs = self.b.block_size
        mask_t = gather_t = None
        if self.decode_tables:
            tables_t = next(tensors).view(len(self.decode_tables), -1)
            lens_t = next(tensors)
            mask_t = torch.arange(tables_t.shape[1] * bs, device=lens_t.device).unsqueeze(0) < lens_t.unsqueeze(1)
            num_kv_heads, num_blocks = self.b.cache_rows
            gather_t = decode_gather_index(tables_t, num_kv_heads, num_blocks)
        kernel_args = {}
        if self.seq_tables:
            table, lens, starts, qlens = (next(tensors).int() for _ in range(4))
            kernel_args = dict(seq_block_tables=table.view(len(self.seq_tables), -1), seq_ctx_lens=lens,
                               seq_q_starts=starts, seq_q_lens=qlens)
        prefills = []
        for q_start, n, end, _ in self.chunks:
            if n == end:  # the chunk is the whole context: attends to its own keys, causally
                prefills.append(PrefillChunk(q_start, n, end, None, None))
                continue
            dev = slots_t.device
            mask = torch.arange(end, device=dev).unsqueeze(0) <= torch.arange(end - n, end, device=dev).unsqueeze(1)
            prefills.append(PrefillChunk(q_start, n, end, _context_slots(next(tensors), end, bs), mask))
        ctx_slots = None
        if self.b.context_slots:
            ctx_slots = torch.cat([_context_slots(next(tensors), c, bs) for c in self.ctx_lens])
        return AttentionMetadata(slot_mapping=slots_t, num_decode=len(self.decode_lens), block_size=bs,
                                 decode_mask=mask_t, decode_gather_index=gather_t, prefills=prefills,
                                 q_lens=self.q_lens, ctx_lens=self.ctx_lens, ctx_slots=ctx_slots, **kernel_args)


def _context_slots(blocks: torch.Tensor, ctx_len: int, bs: int) -> torch.Tensor:
    """Cache slots of positions 0..ctx_len-1 from a sequence's blocks, on the device."""
    return (blocks.unsqueeze(1) * bs + torch.arange(bs, device=blocks.device)).flatten()[:ctx_len]
