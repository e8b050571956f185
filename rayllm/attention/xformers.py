"""xformers attention on CUDA (the `gpu` extra), reading the paged cache in place."""

from __future__ import annotations

import logging

import torch

from rayllm.attention.base import (
    AttentionMetadata,
    AttentionMetadataBuilder,
    PrefillChunk,
    write_cache_block_major,
)
from rayllm.attention.sdpa import attend, prefill_mask
from rayllm.common.errors import first_line

log = logging.getLogger(__name__)


class XformersAttention:
    """xformers on CUDA, reading the paged cache in place.

    The cache is block-major, [num_blocks, block_size, Hk, D] (kv_cache.allocate), which is the
    [1, pages * page_size, Hk, D] key layout of xformers' paged biases. One call per layer covers the
    whole step with `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask`: each sequence's queries attend
    to its context through its block table, causal from the bottom right (a prefill chunk after a
    cached prefix, or a decode row). xformers serves mixed query lengths with its flash kernels (FA3 on
    Hopper); its split-k kernel serves paged decode only (equal query lengths, pages a multiple of 64).
    What xformers refuses on the first try is not tried again: decode rows stay paged when they can and
    the rest is gathered into one varlen batch (BlockDiagonalCausalFromBottomRightMask).
    Sliding-window layers use xformers' local bottom-right mask over the gathered context (a key k is
    seen from query q when q - window < k <= q); soft-capped logits, which xformers' kernels do not
    support, take a per-sequence torch path over the same gathered context.
    """

    name = "xformers"
    cache_layout = "block_major"
    kernels = None

    def __init__(self) -> None:
        from xformers.ops import fmha  # imported only on CUDA: xformers has no CPU ops

        self.fmha = fmha
        self.paged_mixed = True  # one paged call for every sequence of the step
        self.paged_decode = True  # paged call for a step's decode rows

    def metadata_builder(self, block_size: int, kv_caches: list, torch_attention_only: bool) -> AttentionMetadataBuilder:
        """Every sequence's block table for the paged biases and, for when its kernels cannot serve a step's mix
        of query lengths (or a windowed or soft-capped layer), every context slot for a gathered varlen batch."""
        return AttentionMetadataBuilder(block_size, kv_caches, seq_tables=True, context_slots=True)

    def probe(self, device: torch.device, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> None:
        """Raise unless this xformers build runs a varlen causal step on `device` at the model's head dim and
        dtype (what every prefill needs). A wheel built for another torch imports fine but has no CUDA
        kernels: fmha then refuses every call with NotImplementedError."""
        x = torch.zeros(1, 4, 1, 1, head_dim, device=device, dtype=dtype)
        bias = self.fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens([2, 2], [2, 2])
        self.fmha.memory_efficient_attention_forward(x, x, x, attn_bias=bias)

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale: float | None = None,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """As SDPAAttention.__call__."""
        write_cache_block_major(k_cache, meta.slot_mapping, k)
        write_cache_block_major(v_cache, meta.slot_mapping, v)
        t, hq, d = q.shape
        if window is not None or softcap is not None:
            return self._gathered(q, k_cache, v_cache, meta, 0, scale, window, softcap).reshape(t, hq * d)
        nd = meta.num_decode
        if self.paged_mixed or (nd == t and self.paged_decode):
            out = self._try_paged(q, k_cache, v_cache, meta, 0, len(meta.q_lens), "mixed" if nd < t else "decode",
                                  scale)
            if out is not None:
                return out.reshape(t, hq * d)
        out = torch.empty_like(q)
        rest = 0
        if nd and self.paged_decode:
            paged = self._try_paged(q[:nd], k_cache, v_cache, meta, 0, nd, "decode", scale)
            if paged is not None:
                out[:nd], rest = paged, nd
        out[rest:] = self._gathered(q[rest:], k_cache, v_cache, meta, rest, scale)
        return out.reshape(t, hq * d)

    def _try_paged(self, q, k_cache, v_cache, meta, first: int, last: int, kind: str,
                   scale: float | None) -> torch.Tensor | None:
        try:
            return self._paged(q, k_cache, v_cache, meta, first, last, scale)
        except NotImplementedError as exc:  # "No operator found": this GPU/build has no kernel for it
            if kind == "mixed":
                self.paged_mixed = False
            else:
                self.paged_decode = False
            log.warning("xformers has no paged kernel for %s steps here; gathering the context (%s)", kind,
                        first_line(exc))
            return None

    def _paged(self, q, k_cache, v_cache, meta: AttentionMetadata, first: int, last: int,
               scale: float | None) -> torch.Tensor:
        """Sequences first..last-1 (their queries are q) over the cache in place."""
        bias = meta.derived.get(("paged", first, last))
        if bias is None:
            bias = meta.derived[("paged", first, last)] = self.paged_bias(meta, first, last)
        num_blocks, bs, hk, d = k_cache.shape
        group = q.shape[1] // hk
        q5 = q.view(1, q.shape[0], hk, group, d)
        k5 = k_cache.view(1, num_blocks * bs, hk, 1, d).expand(-1, -1, -1, group, -1)
        v5 = v_cache.view(1, num_blocks * bs, hk, 1, d).expand(-1, -1, -1, group, -1)
        return self.fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias, scale=scale).view_as(q)

    def paged_bias(self, meta: AttentionMetadata, first: int, last: int):
        """The paged causal-with-offset bias of sequences first..last-1, from tensors already on the
        device (xformers' from_seqlens would copy Python lists to it, a host sync per step)."""
        assert meta.seq_block_tables is not None and meta.seq_ctx_lens is not None
        assert meta.seq_q_starts is not None
        ab = self.fmha.attn_bias
        q_lens, ctx_lens = meta.q_lens[first:last], meta.ctx_lens[first:last]
        tables = meta.seq_block_tables[first:last]
        starts = meta.seq_q_starts[first:last]
        q_start_py = [0]
        for n in q_lens:
            q_start_py.append(q_start_py[-1] + n)
        q_seqstart = torch.cat([starts - starts[:1], starts.new_full((1,), q_start_py[-1])])
        pad = tables.shape[1] * meta.block_size
        n = last - first
        k_info = ab._PaddedSeqLenInfo(
            seqstart=torch.arange(0, (n + 1) * pad, pad, dtype=torch.int32, device=tables.device),
            max_seqlen=max(ctx_lens), min_seqlen=min(ctx_lens), seqstart_py=list(range(0, (n + 1) * pad, pad)),
            seqlen=meta.seq_ctx_lens[first:last], seqlen_py=list(ctx_lens), padding=pad,
        )
        q_info = ab._SeqLenInfo(seqstart=q_seqstart, max_seqlen=max(q_lens), min_seqlen=min(q_lens),
                                seqstart_py=q_start_py)
        return ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(
            q_seqinfo=q_info, k_seqinfo=k_info, block_tables=tables, page_size=meta.block_size)

    def _gathered(self, q, k_cache, v_cache, meta: AttentionMetadata, first_seq: int, scale: float | None,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Sequences from first_seq on, their contexts copied out of the cache into one varlen batch."""
        assert meta.ctx_slots is not None
        hk, d = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // hk
        skip = sum(meta.ctx_lens[:first_seq])
        slots = meta.ctx_slots[skip:]
        kc = k_cache.view(-1, hk, d).index_select(0, slots)
        vc = v_cache.view(-1, hk, d).index_select(0, slots)
        q_lens, ctx_lens = meta.q_lens[first_seq:], meta.ctx_lens[first_seq:]
        if softcap is not None:
            return self._softcapped(q, kc, vc, q_lens, ctx_lens, d**-0.5 if scale is None else scale, window,
                                    softcap)
        masks = self.fmha.attn_bias
        if window is None:
            bias = masks.BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_lens, ctx_lens)
        else:
            bias = masks.BlockDiagonalCausalLocalAttentionFromBottomRightMask.from_seqlens(
                q_lens, ctx_lens, window_size=window)
        # GQA via the 5-D [B, M, G, H, K] layout: KV heads are groups, expanded without copying.
        q5 = q.view(1, q.shape[0], hk, group, d)
        k5 = kc.view(1, -1, hk, 1, d).expand(-1, -1, -1, group, -1)
        v5 = vc.view(1, -1, hk, 1, d).expand(-1, -1, -1, group, -1)
        return self.fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias, scale=scale).view_as(q)

    @staticmethod
    def _softcapped(q, kc, vc, q_lens: list[int], ctx_lens: list[int], scale: float, window: int | None,
                    softcap: float) -> torch.Tensor:
        out = torch.empty_like(q)
        q_start = k_start = 0
        for n, ctx in zip(q_lens, ctx_lens, strict=True):
            chunk = PrefillChunk(q_start, n, ctx, None, None)
            mask = prefill_mask(chunk, window, q.device)
            o = attend(q[q_start : q_start + n].transpose(0, 1).unsqueeze(0),
                       kc[k_start : k_start + ctx].transpose(0, 1).unsqueeze(0),
                       vc[k_start : k_start + ctx].transpose(0, 1).unsqueeze(0), mask, scale, softcap)
            out[q_start : q_start + n] = o.squeeze(0).transpose(0, 1)
            q_start, k_start = q_start + n, k_start + ctx
        return out
