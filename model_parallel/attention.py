"""Paged attention behind one small interface: torch SDPA (CPU, reference) and xformers (CUDA).

The model runner lays a step's tokens out flat, decode tokens first, then each prefill chunk, and
builds `AttentionMetadata` once per step; every layer reuses it. New keys/values are written into
the paged cache by slot, then each query attends to its sequence's cached context.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class PrefillChunk:
    q_start: int  # offset of the chunk in the flat token layout
    q_len: int
    ctx_len: int  # tokens attended to, this chunk included
    slots: torch.Tensor | None  # cache slots of the whole context; None when the chunk is the whole context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal shifted by the cached prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    num_decode: int
    block_size: int
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] each decode sequence's blocks (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool: position < context length
    prefills: list[PrefillChunk] = field(default_factory=list)
    # For varlen backends: per-sequence query and context lengths in flat order, and all context slots.
    q_lens: list[int] = field(default_factory=list)
    ctx_lens: list[int] = field(default_factory=list)
    ctx_slots: torch.Tensor | None = None


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache: [num_blocks, Hk, block_size, D]; slot = block * block_size + offset; values: [T, Hk, D]."""
    bs = cache.shape[2]
    cache[slots // bs, :, slots % bs] = values


def read_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [n, Hk, D] of the given slots, in order."""
    bs = cache.shape[2]
    return cache[slots // bs, :, slots % bs]


def decode_attention(q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """One query per sequence over its paged context, block by block, as batched matmuls.

    Measured on CPU: SDPA's flash kernel spends ~350 us per call on single-token queries. Here whole
    blocks are gathered (one contiguous [Hk, block_size, D] slab each) and multiplied in place, with
    no per-slot indexing and no transposed copy of the context; KV heads stay a batch dimension, so
    GQA needs no repeated K/V. Positions past a sequence's length are masked.
    """
    b, hq, d = q.shape
    hk = k_cache.shape[1]
    kb = k_cache[meta.decode_block_tables]  # [B, nb, Hk, bs, D]
    vb = v_cache[meta.decode_block_tables]
    nb, bs = kb.shape[1], kb.shape[3]
    qg = (q.view(b, 1, hk, hq // hk, d) * d**-0.5).expand(b, nb, hk, hq // hk, d)
    scores = torch.matmul(qg, kb.transpose(-1, -2)).float()  # [B, nb, Hk, G, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(b, hk, hq // hk, nb * bs)
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype).view(b, hk, hq // hk, nb, bs).permute(0, 3, 1, 2, 4)
    return torch.matmul(probs, vb).sum(1).reshape(b, hq, d)  # [B, nb, Hk, G, D] summed over blocks


def context_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[1, Hk, n, D] of one sequence's context, for SDPA."""
    return read_cache(cache, slots).transpose(0, 1).unsqueeze(0)


class SDPAAttention:
    name = "sdpa"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]; caches: [num_blocks, Hk, block_size, D]. Returns [T, Hq*D]."""
        write_cache(k_cache, meta.slot_mapping, k)
        write_cache(v_cache, meta.slot_mapping, v)
        t, hq, d = q.shape
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta)
        for p in meta.prefills:
            qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if p.slots is None:
                ks = k[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
                vs = v[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            else:
                ks, vs = context_kv(k_cache, p.slots), context_kv(v_cache, p.slots)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True
            )
            out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
        return out.reshape(t, hq * d)


class XformersAttention:
    """xformers memory-efficient attention over all sequences at once (CUDA only).

    Context keys/values are gathered from the paged cache into one flat varlen batch; a
    bottom-right-aligned block-diagonal causal mask covers decode (q_len 1) and chunked prefill alike.
    """

    name = "xformers"

    def __init__(self) -> None:
        from xformers.ops import fmha  # imported only on CUDA: xformers has no CPU ops

        self.fmha = fmha

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_cache(k_cache, meta.slot_mapping, k)
        write_cache(v_cache, meta.slot_mapping, v)
        t, hq, d = q.shape
        hk = k.shape[1]
        group = hq // hk
        kc = read_cache(k_cache, meta.ctx_slots)  # [sum ctx, Hk, D]
        vc = read_cache(v_cache, meta.ctx_slots)
        bias = self.fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(meta.q_lens, meta.ctx_lens)
        # GQA via the 5-D [B, M, G, H, K] layout: KV heads are groups, expanded without copying.
        q5 = q.view(1, t, hk, group, d)
        k5 = kc.view(1, -1, hk, 1, d).expand(-1, -1, -1, group, -1)
        v5 = vc.view(1, -1, hk, 1, d).expand(-1, -1, -1, group, -1)
        out = self.fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias)
        return out.reshape(t, hq * d)


def make_attention_backend(choice: str, device: torch.device) -> SDPAAttention | XformersAttention:
    """auto: xformers on CUDA when it loads, else SDPA; an explicit choice is honoured or fails."""
    if choice == "sdpa" or (choice == "auto" and device.type != "cuda"):
        return SDPAAttention()
    if device.type != "cuda":
        raise ValueError("attention_backend xformers needs CUDA")
    try:
        return XformersAttention()
    except Exception as exc:  # missing extra, or built for another torch/CUDA
        if choice == "xformers":
            raise
        log.warning("xformers unavailable (%s); using torch SDPA memory-efficient attention", exc)
        return SDPAAttention()
