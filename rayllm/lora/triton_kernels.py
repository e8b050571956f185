"""Batched LoRA deltas in Triton (GPU): one shrink and one expand launch per projection, whatever the
number of adapters in the step (Punica's SGMV, as vLLM's Triton LoRA kernels do it).

Tokens are grouped by slot on the device (a stable argsort of the per-token slot tensor, per-slot counts
and starts from scatter_add/cumsum): no host sync and no shapes that follow the adapter mix, so the
step's only LoRA input is `token_slots` [T] (slot 0 = base model), which a CUDA graph can take as a
static input buffer. The grid is (tiles of T x tiles of the output width, slots); a program whose slot
has no tokens in its tile, or whose slot's adapter does not target this layer (width 0), returns at once.

Layout is LoRALinear's: A [slots, W, K], B [slots, N, W] with W = n_sub * max_lora_rank, interleaved
ranks; `widths[slot]` = rank * n_sub of the slot's adapter (0: not loaded or not targeting this layer),
so padding past an adapter's rank is neither read nor multiplied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class TokenGroups:
    """The step's tokens sorted by slot; shared by every projection of the step."""

    sorted_tokens: torch.Tensor  # [T] int32, token rows grouped by slot (stable)
    counts: torch.Tensor  # [S] int32 tokens per slot
    starts: torch.Tensor  # [S] int32 offset of each slot's group in sorted_tokens


def group_tokens(token_slots: torch.Tensor, num_slots: int) -> TokenGroups:
    """Device-side grouping (no .item(), no data-dependent shapes: safe inside CUDA graph capture)."""
    slots = token_slots.long()
    counts = torch.zeros(num_slots, dtype=torch.long, device=slots.device)
    counts.scatter_add_(0, slots, torch.ones_like(slots))
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(slots, stable=True)
    return TokenGroups(order.to(torch.int32), counts.to(torch.int32), starts.to(torch.int32))


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, mid_ptr, tok_ptr, cnt_ptr, start_ptr, width_ptr, K, W,
                   sx, sa_slot, sa_w, sm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    slot = tl.program_id(1)
    count = tl.load(cnt_ptr + slot)
    width = tl.load(width_ptr + slot)
    n_tiles = tl.cdiv(W, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    if slot == 0 or width == 0 or pid_m * BLOCK_M >= count or pid_n * BLOCK_N >= width:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + tl.load(start_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * sa_slot
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * sx + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_n[None, :] * sa_w + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                     other=0.0)
        if UPCAST:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    tl.store(mid_ptr + rows[:, None] * sm + offs_n[None, :], acc.to(mid_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_kernel(mid_ptr, b_ptr, out_ptr, tok_ptr, cnt_ptr, start_ptr, width_ptr, N,
                   sm, sb_slot, sb_n, so, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr):
    slot = tl.program_id(1)
    count = tl.load(cnt_ptr + slot)
    width = tl.load(width_ptr + slot)
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    if slot == 0 or width == 0 or pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + tl.load(start_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * sb_slot
    for r0 in range(0, width, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < width
        mt = tl.load(mid_ptr + rows[:, None] * sm + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        bt = tl.load(b_base + offs_n[None, :] * sb_n + offs_r[:, None], mask=n_mask[None, :] & r_mask[:, None],
                     other=0.0)
        if UPCAST:
            mt, bt = mt.to(tl.float32), bt.to(tl.float32)
        acc += tl.dot(mt, bt, input_precision=PRECISION)
    o_ptrs = out_ptr + rows[:, None] * so + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    prev = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


# Triton's interpreter multiplies bf16 tiles as raw bits in tl.dot (numpy has no bf16): there the tiles
# are widened to fp32 first. Read at import, as Triton itself reads TRITON_INTERPRET.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # tl.dot's smallest tile; decode steps have a few tokens per adapter


def lora_shrink(x: torch.Tensor, a: torch.Tensor, groups: TokenGroups, widths: torch.Tensor) -> torch.Tensor:
    """mid[t] = A[slot(t)] x[t] ([T, W], x's dtype; zero for base tokens). x [T, K], a [S, W, K]."""
    t, k = x.shape
    s, w, _ = a.shape
    assert x.stride(1) == 1 and a.stride(2) == 1
    mid = torch.zeros(t, w, dtype=x.dtype, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(w)))
    grid = (triton.cdiv(t, BLOCK_M) * triton.cdiv(w, block_n), s)
    _shrink_kernel[grid](x, a, mid, groups.sorted_tokens, groups.counts, groups.starts, widths, k, w,
                         x.stride(0), a.stride(0), a.stride(1), mid.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64, PRECISION=_precision(x.dtype), UPCAST=INTERPRET)
    return mid


def lora_expand(mid: torch.Tensor, b: torch.Tensor, out: torch.Tensor, groups: TokenGroups,
                widths: torch.Tensor) -> torch.Tensor:
    """out[t] += B[slot(t)] mid[t] in place. mid [T, W], b [S, N, W], out [T, N]."""
    t, w = mid.shape
    s, n, _ = b.shape
    assert b.stride(2) == 1 and out.stride(1) == 1
    block_n = 64
    grid = (triton.cdiv(t, BLOCK_M) * triton.cdiv(n, block_n), s)
    _expand_kernel[grid](mid, b, out, groups.sorted_tokens, groups.counts, groups.starts, widths, n,
                         mid.stride(0), b.stride(0), b.stride(1), out.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=16, PRECISION=_precision(b.dtype), UPCAST=INTERPRET)
    return out


def lora_apply(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, groups: TokenGroups,
               widths: torch.Tensor) -> torch.Tensor:
    """out += B_s A_s x per token (its slot s): one shrink and one expand launch for the projection."""
    return lora_expand(lora_shrink(x, a, groups, widths), b, out, groups, widths)


def _precision(dtype: torch.dtype) -> str:
    """fp32 buffers multiply in full fp32 (Triton would use tf32); half types use the tensor cores as is."""
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"
