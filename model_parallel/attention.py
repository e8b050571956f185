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
    decode_slots: torch.Tensor | None  # [B, Lmax] cache slots of each decode sequence's context (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool
    prefills: list[PrefillChunk] = field(default_factory=list)
    # For varlen backends: per-sequence query and context lengths in flat order, and all context slots.
    q_lens: list[int] = field(default_factory=list)
    ctx_lens: list[int] = field(default_factory=list)
    ctx_slots: torch.Tensor | None = None


def decode_attention(q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """One query per sequence over its paged context, as two small batched matmuls.

    Measured on CPU: SDPA's flash kernel spends ~350 us per call on single-token queries; plain
    batched matmuls with KV heads as the batch (GQA without repeating K/V) are several times faster.
    """
    b, hq, d = q.shape
    hk = k_cache.shape[1]
    kd = k_cache[meta.decode_slots].permute(0, 2, 3, 1)  # [B, Hk, D, L]
    vd = v_cache[meta.decode_slots].transpose(1, 2)  # [B, Hk, L, D]
    qg = q.view(b, hk, hq // hk, d) * d**-0.5
    scores = torch.matmul(qg, kd).float()  # [B, Hk, G, L]
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, vd).reshape(b, hq, d)


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
        """q: [T, Hq, D]; k, v: [T, Hk, D]; caches: [num_slots, Hk, D]. Returns [T, Hq*D]."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        t, hq, d = q.shape
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta)
        for p in meta.prefills:
            qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if p.slots is None:
                ks = k[p.q_start : p.q_start + p.q_len]
                vs = v[p.q_start : p.q_start + p.q_len]
            else:
                ks, vs = k_cache[p.slots], v_cache[p.slots]
            ks = ks.transpose(0, 1).unsqueeze(0)
            vs = vs.transpose(0, 1).unsqueeze(0)
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
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        t, hq, d = q.shape
        hk = k.shape[1]
        group = hq // hk
        kc = k_cache[meta.ctx_slots]  # [sum ctx, Hk, D]
        vc = v_cache[meta.ctx_slots]
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
