"""Prefill attention over the paged KV cache in one Triton kernel, FlashAttention-2 style.

Each program takes one query head and BLOCK_M query rows of one sequence's chunk and walks that
sequence's keys BLOCK_N at a time through its block table, with an online (running max) softmax:
- causal block skipping: a tile reads only the keys up to its last row's position (and, with a sliding
  window, none before its first row's window);
- the key tiles every row of the tile sees whole run without a mask; only the diagonal tiles (and the
  window's edge) compute one;
- when BLOCK_N divides the block size, a key tile lies in one cache block: one table read per tile and
  contiguous [BLOCK_N, D] loads;
- the cached prefix and the chunk's own keys (written to the cache by write_kv just before) are one
  context, so no second pass and no log-sum-exp merge is needed;
- programs are launched heaviest tile first (the last rows of a causal chunk see the most keys), and
  the query heads of one KV head sit side by side in the grid, so their K/V tiles are read from L2;
- logit soft-capping (Gemma 2: cap * tanh(s / cap)) and sliding windows (a key k is seen from the query
  at q when q - window < k <= q) are compile-time options.

`TritonPrefillAttention` is the `triton` attention backend: decode rows keep triton_kernels' decode
kernel (split over the SMs), prefill chunks take this one; models with windowed or soft-capped layers
run every row through this kernel (the decode kernel has neither).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rayllm.attention.base import AttentionMetadata
from rayllm.attention.triton import StepArgs, TritonAttention, _check, _pow2, _rows_ok


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tile choices per (fp32, head dim over 128, one query row per sequence), best first, each with its shared
# memory per block in bytes: the most over sm_80, sm_86, sm_89 and sm_90 at the class's largest padded head
# dim (128 or 256), with soft-capping and a window on. Measured by compiling the kernel for each target
# without a GPU (tests/attention/prefill_smem.py, Triton 3.9; fp16 stands for bf16: the same bytes); sm_90
# takes the most (it pipelines more). Half precision at D <= 128: 128 x 64 with 8 warps, 3 stages (the Triton
# FlashAttention tutorial's Hopper choice); smaller tiles where an element or a row takes twice the memory
# (fp32, D = 256); 16 rows when every sequence has a single query (decode rows of windowed models). At
# D = 256 two pipelined 64 x 64 K/V stages take 106,496 B on sm_80-89 (163,840 on sm_90): over the
# 101,376 B a block may take on sm_86 / sm_89 (A10, L4, L40S, RTX 4090), which get one stage (98,304 B).
TILES: dict[tuple[bool, bool, bool], tuple[tuple[PrefillConfig, int], ...]] = {
    (False, True, False): ((PrefillConfig(64, 64, 8, 2), 163_840), (PrefillConfig(64, 64, 8, 1), 98_304)),
    (False, False, False): ((PrefillConfig(128, 64, 8, 3), 98_308), (PrefillConfig(64, 64, 4, 2), 81_920)),
    (False, True, True): ((PrefillConfig(16, 32, 4, 2), 41_984),),
    (False, False, True): ((PrefillConfig(16, 64, 4, 2), 38_912),),
    (True, True, False): ((PrefillConfig(32, 16, 4, 2), 67_712),),
    (True, False, False): ((PrefillConfig(64, 32, 4, 2), 73_984),),
    (True, True, True): ((PrefillConfig(16, 16, 4, 2), 50_240),),
    (True, False, True): ((PrefillConfig(16, 32, 4, 2), 43_008),),
}


def default_config(head_dim: int, dtype: torch.dtype, q_rows: int,
                   shared_limit: int | None = None) -> PrefillConfig:
    """The first of TILES' choices for the head dim, dtype and rows whose shared memory fits `shared_limit`
    (the device's bytes per block; None: no limit, the interpreter), else the smallest: a head dim over 256
    or a device below sm_80's limits, which the backend's probe at the model's shape then tries."""
    choices = TILES[dtype == torch.float32, head_dim > 128, q_rows <= 1]
    fits = [cfg for cfg, shared in choices if shared_limit is None or shared <= shared_limit]
    return fits[0] if fits else choices[-1][0]


@functools.cache
def shared_limit(device: torch.device) -> int | None:
    """Shared memory a block may take on `device` (opt-in, as Triton's kernels do); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


@triton.jit
def _tanh(x):
    """tanh from exp (libdevice's is CUDA-only, the interpreter has none): exact limits at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _key_tiles(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_ptr, kv_base, c_block, c_pos, block_size, lo, hi, q_pos,
               d, d_ok, qk_scale, softcap, window,
               BLOCK_N: tl.constexpr, TILE_IN_BLOCK: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
               SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Keys lo..hi-1 (lo a multiple of BLOCK_N) into the running (acc, m_i, l_i). MASK: some row of the
    tile does not see some key here (diagonal, window edge, or past the context), so mask scores and
    loads; else every key is valid and seen by every row."""
    for start in range(lo, hi, BLOCK_N):
        j = tl.arange(0, BLOCK_N)
        n = start + j
        if TILE_IN_BLOCK:  # the tile is inside one cache block: one table entry, contiguous rows
            block = tl.load(table_ptr + start // block_size).to(tl.int64)
            kv_off = kv_base + block * c_block + (start % block_size + j) * c_pos
        else:
            block = tl.load(table_ptr + n // block_size, mask=n < hi, other=0).to(tl.int64)
            kv_off = kv_base + block * c_block + (n % block_size) * c_pos
        ptrs = kv_off[:, None] + d[None, :]
        if MASK:
            kv_mask = (n < hi)[:, None] & d_ok[None, :]
            k = tl.load(kc_ptr + ptrs, mask=kv_mask, other=0.0)
            v = tl.load(vc_ptr + ptrs, mask=kv_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(kc_ptr + ptrs)
            v = tl.load(vc_ptr + ptrs)
        else:
            k = tl.load(kc_ptr + ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(vc_ptr + ptrs, mask=d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SOFTCAP:  # qk_scale is then the plain scale: the cap applies to scaled logits
            s = softcap * _tanh(s * (qk_scale / softcap))
            s = s * 1.4426950408889634
        else:
            s = s * qk_scale
        if MASK:
            seen = n[None, :] <= q_pos[:, None]
            if WINDOW:
                seen = seen & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, table_ptr, ctx_ptr, qstart_ptr, qlen_ptr,
    q_row, q_head, o_row, o_head, c_head, c_block, c_pos, table_stride,
    scale, softcap, window, block_size, group, head_dim, n_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (query head, query tile counted from the last, sequence)."""
    head = tl.program_id(0)
    tile = n_tiles - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_len = tl.load(qlen_ptr + seq)
    if tile * BLOCK_M < q_len:
        ctx_len = tl.load(ctx_ptr + seq)
        q_start = tl.load(qstart_ptr + seq).to(tl.int64)
        kv_head = (head // group).to(tl.int64)
        m = tl.arange(0, BLOCK_M)
        row = tile * BLOCK_M + m
        m_ok = row < q_len
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + (q_start + row)[:, None] * q_row + head * q_head + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = ctx_len - q_len + row  # each query's position in the context: it sees keys up to it
        first = ctx_len - q_len + tile * BLOCK_M
        hi = tl.minimum(ctx_len, first + BLOCK_M)  # past the tile's last row: no key is seen
        if WINDOW:
            lo = tl.maximum(0, first - window + 1) // BLOCK_N * BLOCK_N
            # from here on every row's window holds the key (the last row's window starts last)
            full_lo = tl.minimum(hi, tl.maximum(lo, tl.cdiv(tl.maximum(0, hi - window), BLOCK_N) * BLOCK_N))
        else:
            lo = 0
            full_lo = 0
        full_hi = tl.maximum(full_lo, (first + 1) // BLOCK_N * BLOCK_N)  # up to here the first row sees all
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qk_scale = scale if SOFTCAP else scale * 1.4426950408889634  # exp2 below
        table = table_ptr + seq * table_stride
        kv_base = kv_head * c_head
        acc, m_i, l_i = _key_tiles(acc, m_i, l_i, q, kc_ptr, vc_ptr, table, kv_base, c_block, c_pos, block_size,
                                   lo, full_lo, q_pos, d, d_ok, qk_scale, softcap, window, BLOCK_N, TILE_IN_BLOCK,
                                   True, BLOCK_D == head_dim, SOFTCAP, WINDOW, PRECISION)
        acc, m_i, l_i = _key_tiles(acc, m_i, l_i, q, kc_ptr, vc_ptr, table, kv_base, c_block, c_pos, block_size,
                                   full_lo, full_hi, q_pos, d, d_ok, qk_scale, softcap, window, BLOCK_N,
                                   TILE_IN_BLOCK, False, BLOCK_D == head_dim, SOFTCAP, WINDOW, PRECISION)
        acc, m_i, l_i = _key_tiles(acc, m_i, l_i, q, kc_ptr, vc_ptr, table, kv_base, c_block, c_pos, block_size,
                                   full_hi, hi, q_pos, d, d_ok, qk_scale, softcap, window, BLOCK_N, TILE_IN_BLOCK,
                                   True, BLOCK_D == head_dim, SOFTCAP, WINDOW, PRECISION)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + row)[:, None] * o_row + head * o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      step: StepArgs, max_q_len: int, scale: float | None = None, window: int | None = None,
                      softcap: float | None = None, config: PrefillConfig | None = None) -> torch.Tensor:
    """Every sequence of `step` (q rows q_starts[i] .. + q_lens[i]) over its paged context, causal, written
    into `out` at the same rows. q, out: [T, Hq, D]; caches [Hk, num_blocks, block_size, D]; max_q_len:
    no sequence has more query rows (known on the host, so no read-back). Returns out."""
    t, hq, d = q.shape
    hk, _, bs, _ = k_cache.shape
    s = step.ctx_lens.shape[0]
    _check(_rows_ok(q, 3) and _rows_ok(out, 3) and out.shape == q.shape and hq % hk == 0
           and k_cache.shape[-1] == d and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
           and k_cache.stride(-1) == 1 and q.dtype == k_cache.dtype and step.tables.stride(1) == 1,
           "prefill_attention", f"q must be [T, a multiple of {hk}, {d}] in the cache's dtype")
    _check(window is None or window > 0, "prefill_attention", "window must be positive")
    if not t or not s or max_q_len <= 0:
        return out
    cfg = config or default_config(d, q.dtype, max_q_len, shared_limit(q.device))
    n_tiles = triton.cdiv(max_q_len, cfg.block_m)
    _prefill_kernel[(hq, n_tiles, s)](
        q, k_cache, v_cache, out, step.tables, step.ctx_lens, step.q_starts, step.q_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), step.tables.stride(0),
        d**-0.5 if scale is None else scale, softcap or 1.0, window or 1, bs, hq // hk, d, n_tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=_pow2(d, 16), TILE_IN_BLOCK=bs % cfg.block_n == 0,
        SOFTCAP=softcap is not None, WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _sub_step(step: StepArgs, first: int, last: int) -> StepArgs:
    """Sequences first..last-1 of a step (views: no copy)."""
    return StepArgs(step.tables[first:last], step.ctx_lens[first:last], step.q_starts[first:last],
                    step.q_lens[first:last], None)


class TritonPrefillAttention(TritonAttention):
    """The triton backend: TritonAttention, whose prefill chunks take prefill_attention. Decode-only
    steps (and so the CUDA graphs) are TritonAttention's unchanged."""

    windows_and_softcap = True  # model_runner: windowed / soft-capped models get the kernels' metadata

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale: float | None = None,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        t, hq, d = q.shape
        special = window is not None or softcap is not None
        nd = meta.num_decode
        if (meta.seq_block_tables is None or q.dtype != k_cache.dtype
                or k_cache.dtype not in self.kernels.attention_dtypes or (nd == t and not special)):
            return super().__call__(q, k, v, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap)
        step = meta.derived.get("kernel_step")
        if step is None:
            step = meta.derived["kernel_step"] = self.kernels.step_args(
                meta.seq_block_tables, meta.seq_ctx_lens, meta.seq_q_starts, meta.seq_q_lens, meta.slot_mapping)
        self.kernels.write_kv(k, v, k_cache, v_cache, step)
        out = torch.empty_like(q)
        s = len(meta.q_lens)
        if nd and not special:  # decode rows: the decode kernel, split over the SMs
            out[:nd] = self.kernels.paged_attention(q[:nd], k_cache, v_cache, _sub_step(step, 0, nd), scale=scale)
        elif nd:
            prefill_attention(q, k_cache, v_cache, out, _sub_step(step, 0, nd), 1, scale, window, softcap)
        if nd < s:
            prefill_attention(q, k_cache, v_cache, out, _sub_step(step, nd, s), max(meta.q_lens[nd:]), scale, window,
                              softcap)
        return out.view(t, hq * d)

    def probe(self, device: torch.device, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16) -> None:
        """TritonAttention's checks, then a 70-row chunk after a 50-token prefix against SDPA at the model's
        head dim and dtype (the tiles, and so the shared memory a block needs, depend on both; GQA, block
        size 16)."""
        super().probe(device)
        gen = torch.Generator(device=device).manual_seed(1)
        hq, hk, d, bs, ctx, n = 4, 2, head_dim, 16, 120, 70
        k_cache, v_cache = (torch.randn(hk, 8, bs, d, device=device, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(n, hq, d, device=device, generator=gen).to(dtype)
        i32 = dict(dtype=torch.int32, device=device)
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(0)).to(**i32)
        step = StepArgs(perm.view(1, 8), torch.tensor([ctx], **i32), torch.tensor([0], **i32),
                        torch.tensor([n], **i32), None)
        got = prefill_attention(q, k_cache, v_cache, torch.empty_like(q), step, n).float()
        keys = k_cache[:, perm.long()].reshape(hk, 8 * bs, d)[:, :ctx].float()
        values = v_cache[:, perm.long()].reshape(hk, 8 * bs, d)[:, :ctx].float()
        mask = torch.ones(n, ctx, dtype=torch.bool, device=device).tril(ctx - n)
        want = F.scaled_dot_product_attention(q.transpose(0, 1).float(), keys, values, attn_mask=mask,
                                              enable_gqa=True).transpose(0, 1)
        if not torch.allclose(got, want, atol=3e-2, rtol=3e-2):
            raise RuntimeError("Triton prefill attention disagrees with SDPA")
