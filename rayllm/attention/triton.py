"""Fused CUDA kernels in Triton: the GPU counterpart of cpu_kernels.PagedKernels, with the same interface.

A batch-1 decode step of an 8B model ran ~1,000 small kernels besides its GEMMs (casts, residual adds,
the rotary's five ops, the cache writes' index arithmetic, the decode attention's gather, masks and
softmax), each a few microseconds. Each function here is one kernel for one of those groups:
- add_rms_norm: residual add, RMSNorm and the weight, rounding where the torch path rounds;
- rotary_: q and k rotated in place inside the fused qkv projection;
- silu_and_mul: the SwiGLU activation;
- write_kv and paged_attention: the step's new keys/values into the paged cache, and every sequence's
  queries (decode rows and prefill chunks alike) over its context through its block table, causal,
  online softmax; GQA query heads of one KV head share each key tile. Only the context a sequence has
  is read, where the torch decode path gathers every block of the table's width.

Imported only on CUDA (make_attention_backend), and checked against the torch path there before use
(`probe`). Tests run the same kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rayllm.attention.sdpa import SDPAAttention


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(out_ptr.dtype.element_ty)  # the sum is rounded, as torch's add, and is the new residual
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, qkv_stride, n_heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One row, one head: x[i] * cos[i] + x[i +- half] * sin[i] (sin signed for the rotated half)."""
    row, head = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    base = qkv_ptr + row * qkv_stride + head * 2 * HALF
    x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    table = row * 2 * HALF
    c1 = tl.load(cos_ptr + table + i, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + table + HALF + i, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + table + i, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + table + HALF + i, mask=mask, other=0.0)
    tl.store(base + i, (x1 * c1 + x2 * s1).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + i, (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_row, k_head, v_row, v_head,
                     c_head, c_block, c_pos, block_size, head_dim, BLOCK_D: tl.constexpr):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # caches pass 2**31 elements
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        mask = d < head_dim
        dst = h * c_head + (slot // block_size) * c_block + (slot % block_size) * c_pos + d
        tl.store(kc_ptr + dst, tl.load(k_ptr + t * k_row + h * k_head + d, mask=mask), mask=mask)
        tl.store(vc_ptr + dst, tl.load(v_ptr + t * v_row + h * v_head + d, mask=mask), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, table_ptr, ctx_ptr, qstart_ptr, qlen_ptr, part_o_ptr, lse_ptr,
    q_row, q_head, o_row, o_head, c_head, c_block, c_pos, table_stride,
    scale, block_size, group, head_dim, n_heads, n_parts, part_len,
    BLOCK_M: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """Program (sequence, KV head, query tile): the tile's rows x the KV head's query heads form the M
    dimension, BLOCK_M // GROUP_P rows of GROUP_P (padded) heads; keys come BLOCK_N at a time.
    SPLIT (decode rows only): the third axis is a partition of part_len keys instead of a query tile;
    each writes its normalised output and log-sum-exp for _merge_partitions_kernel."""
    seq, kv_head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    if SPLIT:
        tile, part = 0, tl.program_id(2)
    else:
        tile, part = tl.program_id(2), 0
    rows_per_tile: tl.constexpr = BLOCK_M // GROUP_P
    q_len = tl.load(qlen_ptr + seq)
    if tile * rows_per_tile < q_len:
        ctx_len = tl.load(ctx_ptr + seq)
        q_start = tl.load(qstart_ptr + seq)
        m = tl.arange(0, BLOCK_M)
        row = tile * rows_per_tile + m // GROUP_P
        g = m % GROUP_P
        m_ok = (row < q_len) & (g < group)
        head = kv_head * group + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q = tl.load(q_ptr + (q_start + row)[:, None] * q_row + head[:, None] * q_head + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = ctx_len - q_len + row  # each query's own position: it sees keys up to and including it
        last = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * rows_per_tile)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 below
        lo = part * part_len
        hi = tl.minimum(last, lo + part_len)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            block = tl.load(table_ptr + seq * table_stride + n // block_size, mask=n_ok, other=0).to(tl.int64)
            kv_off = kv_head * c_head + block * c_block + (n % block_size) * c_pos
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(kc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see no key at all
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if SPLIT:  # an empty partition (past the context) weighs nothing: its log-sum-exp is -inf
            slot = (seq * n_heads + head) * n_parts + part
            tl.store(part_o_ptr + slot[:, None] * head_dim + d[None, :], out, mask=m_ok[:, None] & d_ok[None, :])
            tl.store(lse_ptr + slot, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i)), mask=m_ok)
        else:
            tl.store(out_ptr + (q_start + row)[:, None] * o_row + head[:, None] * o_head + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_partitions_kernel(part_o_ptr, lse_ptr, out_ptr, qstart_ptr, o_row, o_head, n_heads, n_parts, head_dim,
                             BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (sequence, query head): the partitions' outputs weighted by their share of the softmax."""
    seq, head = tl.program_id(0), tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < n_parts
    base = (seq * n_heads + head) * n_parts
    lse = tl.load(lse_ptr + base + p, mask=p_ok, other=float("-inf"))
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.max(lse, axis=0)))
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    parts = tl.load(part_o_ptr + (base + p)[:, None] * head_dim + d[None, :], mask=p_ok[:, None] & d_ok[None, :],
                    other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    q_start = tl.load(qstart_ptr + seq)
    tl.store(out_ptr + q_start * o_row + head * o_head + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _check(ok: bool, kernel: str, what: str) -> None:
    """A real check (not an assert, which -O removes): a bad shape or stride would index past a tensor."""
    if not ok:
        raise ValueError(f"{kernel}: {what}")


def _rows_ok(x: torch.Tensor, dims: int) -> bool:
    """Rows may be strided, the last dimension must be packed."""
    return x.dim() == dims and x.stride(-1) == 1


@dataclass
class StepArgs:
    """A step's sequence inputs for write_kv and paged_attention (as cpu_kernels.StepArgs), on the device."""

    tables: torch.Tensor  # [S, width] int32
    ctx_lens: torch.Tensor  # [S] int32
    q_starts: torch.Tensor  # [S] int32
    q_lens: torch.Tensor  # [S] int32
    slots: torch.Tensor | None  # [T] int64


class TritonKernels:
    """Triton kernels on CUDA tensors (bf16 for norm, SiLU and rotary; bf16, fp16 or fp32 for attention)."""

    # As cpu_kernels.PagedKernels: the dtypes the model's layers may hand each group of kernels.
    attention_dtypes = frozenset({torch.bfloat16, torch.float16, torch.float32})
    rotary_dtypes = fused_dtypes = frozenset({torch.bfloat16, torch.float16})

    def __init__(self, sm_count: int | None = None) -> None:
        self.sm_count = sm_count  # the device's multiprocessors (read at first use): sizes decode's split

    def step_args(self, block_tables: torch.Tensor, ctx_lens: torch.Tensor, q_starts: torch.Tensor | None = None,
                  q_lens: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> StepArgs:
        s = ctx_lens.shape[0]
        _check(block_tables.dim() == 2 and block_tables.shape[0] == s and block_tables.stride(1) == 1,
               "paged_attention", "block_tables must be [S, max_blocks], rows packed")
        if q_lens is None or q_starts is None:
            q_starts = torch.arange(s, dtype=torch.int32, device=ctx_lens.device)
            q_lens = torch.ones(s, dtype=torch.int32, device=ctx_lens.device)
        _check(q_starts.shape == (s,) and q_lens.shape == (s,), "paged_attention", "q_starts and q_lens must be [S]")
        return StepArgs(block_tables, ctx_lens, q_starts, q_lens, slots)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor | StepArgs) -> None:
        """k, v: [T, Hk, D] (rows may be strided); caches [Hk, num_blocks, block_size, D]; slots [T] (negative:
        skipped), or a step's StepArgs holding them."""
        slot_t = slots.slots if isinstance(slots, StepArgs) else slots
        _check(slot_t is not None and slot_t.shape == (k.shape[0],), "write_kv", "slots must be [T]")
        assert slot_t is not None  # for the type checker; checked just above
        hk, _, bs, d = k_cache.shape
        _check(_rows_ok(k, 3) and _rows_ok(v, 3) and k.shape == v.shape and k.shape[1:] == (hk, d)
               and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
               and k_cache.stride(-1) == 1, "write_kv", f"k, v must be [T, {hk}, {d}] and the caches alike")
        if k.shape[0]:
            _write_kv_kernel[(k.shape[0], hk)](
                k, v, k_cache, v_cache, slot_t, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bs, d, BLOCK_D=_pow2(d))

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepArgs,
                        scale: float | None = None) -> torch.Tensor:
        """q [T, Hq, D] over caches [Hk, num_blocks, block_size, D]; returns [T, Hq, D]."""
        t, hq, d = q.shape
        hk, _, bs, _ = k_cache.shape
        s = step.ctx_lens.shape[0]
        _check(_rows_ok(q, 3) and hq % hk == 0 and k_cache.shape[-1] == d and q.dtype == k_cache.dtype,
               "paged_attention", f"q must be [T, a multiple of {hk}, {d}] in the cache's dtype")
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        if not t:
            return out
        group = hq // hk
        group_p = _pow2(group)
        # Decode-only steps: one row per tile; prefill chunks: up to 64 (row, head) pairs a tile.
        block_m, block_n = (max(16, group_p), 32) if t == s else (max(64, group_p), 64)
        rows = block_m // group_p
        n_parts, part_len = self.partitions(s * hk, step.tables.shape[1] * bs, block_n, q.device) if t == s else (1, 0)
        part_o = lse = out  # placeholders: read only when split
        if n_parts > 1:
            part_o = torch.empty(s * hq * n_parts * d, dtype=torch.float32, device=q.device)
            lse = torch.empty(s * hq * n_parts, dtype=torch.float32, device=q.device)
            grid = (s, hk, n_parts)
        else:
            max_q = t - s + 1  # without reading the lengths back: no sequence has more rows than this
            grid, part_len = (s, hk, triton.cdiv(max_q, rows)), 1 << 30
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, step.tables, step.ctx_lens, step.q_starts, step.q_lens, part_o, lse,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), step.tables.stride(0),
            d**-0.5 if scale is None else scale, bs, group, d, hq, n_parts, part_len,
            BLOCK_M=block_m, GROUP_P=group_p, BLOCK_N=block_n, BLOCK_D=_pow2(d, 16),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=n_parts > 1,
        )
        if n_parts > 1:
            _merge_partitions_kernel[(s, hq)](part_o, lse, out, step.q_starts, out.stride(0), out.stride(1), hq,
                                              n_parts, d, BLOCK_P=_pow2(n_parts), BLOCK_D=_pow2(d, 16))
        return out

    def partitions(self, programs: int, max_ctx: int, block_n: int, device: torch.device) -> tuple[int, int]:
        """(partitions, keys each) for a decode step of `programs` (sequence, KV head) pairs whose contexts
        fit in max_ctx (the block tables' width, fixed per captured graph): enough partitions to give
        every SM two programs, of at least two key tiles each. At batch 1 with 8 KV heads, unsplit, 8 SMs
        of 132 would walk the whole context."""
        if self.sm_count is None:
            self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        want = triton.cdiv(2 * self.sm_count, programs)
        if want <= 1:
            return 1, 0
        part_len = max(2 * block_n, triton.cdiv(triton.cdiv(max_ctx, want), block_n) * block_n)
        return triton.cdiv(max_ctx, part_len), part_len

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H]: (weight * rms_norm(x + residual), x + residual); the sum is written into `residual` in
        place (the caller's old residual is dead after the call)."""
        _check(_rows_ok(x, 2) and weight.shape == (x.shape[1],) and weight.is_contiguous()
               and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)),
               "add_rms_norm", "x and residual must be [T, H] with packed rows, weight [H]")
        t, h = x.shape
        out = torch.empty(t, h, dtype=x.dtype, device=x.device)
        if t:
            block = _pow2(h)
            res = residual if residual is not None else x
            _add_rms_norm_kernel[(t,)](x, res, weight, out, h, x.stride(0), res.stride(0), out.stride(0), eps,
                                       HAS_RES=residual is not None, BLOCK=block,
                                       num_warps=min(16, max(1, block // 512)))
        return out, residual if residual is not None else x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> [T, I]."""
        _check(_rows_ok(x, 2) and x.shape[1] % 2 == 0, "silu_and_mul", "x must be [T, 2I] with packed rows")
        t, width = x.shape
        out = torch.empty(t, width // 2, dtype=x.dtype, device=x.device)
        if t:
            block = 1024
            _silu_and_mul_kernel[(t, triton.cdiv(width // 2, block))](x, out, width // 2, x.stride(0), out.stride(0),
                                                                       BLOCK=block)
        return out

    def rotary_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first num_heads heads of each row of qkv ([T, width], packed rows) in place; cos, sin:
        contiguous fp32 with T rows of head_dim (RotaryEmbedding.tables)."""
        t = qkv.shape[0]
        _check(head_dim % 2 == 0 and _rows_ok(qkv, 2) and num_heads * head_dim <= qkv.shape[1], "rotary",
               f"qkv must be [T, >= {num_heads} x {head_dim}] with packed rows")
        _check(all(x.is_contiguous() and x.dtype == torch.float32 and x.numel() == t * head_dim for x in (cos, sin)),
               "rotary", f"cos and sin must be contiguous fp32 with {t} rows of {head_dim}")
        if t and num_heads:
            _rotary_kernel[(t, num_heads)](qkv, cos, sin, qkv.stride(0), num_heads, HALF=head_dim // 2,
                                           BLOCK=_pow2(head_dim // 2))

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)


class TritonAttention(SDPAAttention):
    """SDPAAttention with the Triton kernels: one write and one attention kernel per layer for every
    sequence of the step, and the fused norm, rotary and SiLU kernels for the model's layers (they
    find them as the backend's `kernels`). Windowed and soft-capped layers keep the torch path."""

    name = "triton"

    def __init__(self) -> None:
        super().__init__(TritonKernels())  # type: ignore[arg-type]  # cpu_kernels.PagedKernels' interface

    def probe(self, device: torch.device) -> None:
        """Raise unless the kernels compile and agree with the torch path on `device`: one decode row and
        one 3-token chunk after a 2-token prefix, GQA, bf16, against SDPA over the same keys."""
        kernels = TritonKernels()
        hq, hk, d, bs = 4, 2, 64, 16
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, generator=gen).bfloat16()

        k_cache, v_cache = rand(hk, 4, bs, d), rand(hk, 4, bs, d)
        q, k, v = rand(4, hq, d), rand(4, hk, d), rand(4, hk, d)
        i32 = dict(dtype=torch.int32, device=device)
        step = kernels.step_args(torch.tensor([[2], [1]], **i32), torch.tensor([7, 5], **i32),
                                 torch.tensor([0, 1], **i32), torch.tensor([1, 3], **i32),
                                 torch.tensor([38, 18, 19, 20], device=device))
        kernels.write_kv(k, v, k_cache, v_cache, step)
        out = kernels.paged_attention(q, k_cache, v_cache, step).float()
        for (block, ctx, start, n) in ((2, 7, 0, 1), (1, 5, 1, 3)):
            keys, values = k_cache[:, block, :ctx].float(), v_cache[:, block, :ctx].float()
            mask = torch.ones(n, ctx, dtype=torch.bool, device=device).tril(ctx - n)
            want = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1).float(), keys, values,
                                                  attn_mask=mask, enable_gqa=True).transpose(0, 1)
            if not torch.allclose(out[start : start + n], want, atol=3e-2, rtol=3e-2):
                raise RuntimeError("Triton paged attention disagrees with SDPA")
        x = rand(3, 256)
        normed, _ = kernels.add_rms_norm(x, None, torch.ones(256, device=device, dtype=torch.bfloat16), 1e-6)
        if not torch.allclose(normed.float(), F.rms_norm(x.float(), (256,), eps=1e-6), atol=3e-2, rtol=3e-2):
            raise RuntimeError("Triton RMSNorm disagrees with torch")
