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

from model_parallel import cpu_kernels
from model_parallel.cpu_kernels import PagedKernels

log = logging.getLogger(__name__)


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


def decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence over its paged context, as two batched matmuls per KV head and sequence.

    The cache is head-major ([Hk, num_blocks, block_size, D]), so one `index_select` of whole blocks
    lays each (head, sequence) context out contiguously as [Hk, B, L, D]; KV heads stay a batch
    dimension, so GQA needs no repeated K/V. Measured on 2 CPU cores (batch 64, 100-token contexts):
    1.2 ms per layer against 3.4 ms for block-by-block matmuls over advanced-indexed blocks, and
    8 ms for SDPA. Positions past a sequence's length are masked.
    """
    b, hq, d = q.shape
    hk, num_blocks, bs, _ = k_cache.shape
    index = meta.decode_gather_index
    assert index is not None and meta.decode_mask is not None
    ctx = index.numel() // (hk * b) * bs
    k = k_cache.view(hk * num_blocks, bs, d).index_select(0, index).view(hk, b, ctx, d)
    v = v_cache.view(hk * num_blocks, bs, d).index_select(0, index).view(hk, b, ctx, d)
    qg = q.view(b, hk, hq // hk, d).transpose(0, 1) * (d**-0.5 if scale is None else scale)  # [Hk, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [Hk, B, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = meta.decode_mask if window is None else _decode_window_mask(meta, window)
    scores.masked_fill_(~mask.view(1, b, 1, ctx), float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, hq, d)


def _decode_window_mask(meta: AttentionMetadata, window: int) -> torch.Tensor:
    """decode_mask, less the positions a sliding window of `window` keys has left behind."""
    key = ("decode", window)
    if key not in meta.derived:
        mask = meta.decode_mask
        assert mask is not None
        lens = torch.tensor(meta.ctx_lens[: mask.shape[0]], device=mask.device).unsqueeze(1)
        meta.derived[key] = mask & (torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) >= lens - window)
    return meta.derived[key]


def prefill_mask(p: PrefillChunk, window: int | None, device) -> torch.Tensor | None:
    """[q_len, ctx_len] bool for a chunk: causal, and within the window when there is one (a key at
    position k is seen from query position q when q - window < k <= q, as transformers' and xformers'
    local masks); None means plain causal over a fresh chunk."""
    if window is None:
        return p.mask
    q_pos = torch.arange(p.ctx_len - p.q_len, p.ctx_len, device=device).unsqueeze(1)
    k_pos = torch.arange(p.ctx_len, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None) -> torch.Tensor:
    """q [1, Hq, n, D], k/v [1, Hk, m, D]: SDPA, or explicit scores when logits are soft-capped
    (tanh(s / cap) * cap before the mask, as Gemma 2), which SDPA cannot express."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, m = q.shape[2], k.shape[2]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def context_kv(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[1, Hk, n, D] of one sequence's context, for SDPA."""
    bs = cache.shape[2]
    return cache[:, slots // bs, slots % bs].unsqueeze(0)


class SDPAAttention:
    """CPU attention. With the C kernels (cpu_kernels.py): cache writes and one call for every
    sequence of the step, decode rows and prefill chunks alike. Without them: the torch decode path
    above, and torch SDPA per prefill chunk."""

    name = "sdpa"
    cache_layout = "head_major"

    def __init__(self, kernels: PagedKernels | None = None) -> None:
        self.kernels = kernels

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]; caches: [Hk, num_blocks, block_size, D]. Returns [T, Hq*D].

        scale: of q.k (default D^-0.5); window: keys within this many positions of the query (sliding
        window layers); softcap: tanh soft-capping of attention logits. The C kernel does neither
        window nor softcap: models with such layers ask the runner for the torch metadata
        (`torch_attention_only`), so those steps never take this first branch."""
        t, hq, d = q.shape
        scale = d**-0.5 if scale is None else scale
        if (self.kernels is not None and meta.seq_block_tables is not None
                and k_cache.dtype in self.kernels.attention_dtypes):
            if window is not None or softcap is not None:
                raise RuntimeError("windowed or soft-capped attention needs the torch metadata")
            step = meta.derived.get("kernel_step")
            if step is None:  # the step's sequence inputs, checked by the first layer for all of them
                step = meta.derived["kernel_step"] = self.kernels.step_args(
                    meta.seq_block_tables, meta.seq_ctx_lens, meta.seq_q_starts, meta.seq_q_lens, meta.slot_mapping)
            self.kernels.write_kv(k, v, k_cache, v_cache, step)
            out = self.kernels.paged_attention(q, k_cache, v_cache, step, scale=scale)
            return out.view(t, hq * d)
        write_cache(k_cache, meta.slot_mapping, k)
        write_cache(v_cache, meta.slot_mapping, v)
        nd = meta.num_decode
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta, scale, window, softcap)
        for p in meta.prefills:
            qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if p.slots is None:
                ks = k[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
                vs = v[p.q_start : p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            else:
                ks, vs = context_kv(k_cache, p.slots), context_kv(v_cache, p.slots)
            o = attend(qs, ks, vs, prefill_mask(p, window, q.device), scale, softcap)
            out[p.q_start : p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
        return out.reshape(t, hq * d)


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

    def __init__(self) -> None:
        from xformers.ops import fmha  # imported only on CUDA: xformers has no CPU ops

        self.fmha = fmha
        self.paged_mixed = True  # one paged call for every sequence of the step
        self.paged_decode = True  # paged call for a step's decode rows

    def probe(self, device: torch.device) -> None:
        """Raise unless this xformers build runs a varlen causal step on `device` (what every prefill
        needs). A wheel built for another torch imports fine but has no CUDA kernels: fmha then refuses
        every call with NotImplementedError."""
        x = torch.zeros(1, 4, 1, 1, 64, device=device, dtype=torch.bfloat16)
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
                        str(exc).splitlines()[0])
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


def make_attention_backend(choice: str, device: torch.device) -> SDPAAttention | XformersAttention:
    """auto: on CUDA, the Triton kernels when they compile and agree with torch (triton_kernels.py; the
    backend measured on a GPU, docs/benchmarks.md), else xformers when its kernels run here, else torch
    SDPA; on CPU, SDPAAttention with the C kernels when they build. sdpa: torch only (the reference
    path). An explicit choice is honoured or fails."""
    if choice == "sdpa":
        return SDPAAttention()
    if choice == "auto" and device.type != "cuda":
        return SDPAAttention(cpu_kernels.load())
    if device.type != "cuda":
        raise ValueError(f"attention_backend {choice} needs CUDA")
    for name in ("triton", "xformers"):
        if choice not in ("auto", name):
            continue
        try:
            backend = XformersAttention() if name == "xformers" else _triton_backend()
            backend.probe(device)
            return backend
        except Exception as exc:  # missing extra, built for another torch/CUDA, or no compiler for this GPU
            if choice == name:
                raise
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            log.warning("%s attention unavailable (%s)", name, reason)
    log.warning("using torch SDPA attention")
    return SDPAAttention()


def _triton_backend() -> SDPAAttention:
    from model_parallel.triton_prefill import TritonPrefillAttention  # imports triton: CUDA only

    return TritonPrefillAttention()
