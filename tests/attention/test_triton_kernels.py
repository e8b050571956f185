"""The Triton kernels (rayllm/attention/triton.py) against the torch paths they replace.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set before the import): the same
kernel code, executed on CPU tensors. The GPU lane runs this file natively on CUDA. Inputs are random.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from rayllm.attention.base import write_cache  # noqa: E402
from rayllm.attention.triton import TritonKernels  # noqa: E402
from rayllm.layers.basic import RMSNorm, RotaryEmbedding, silu_and_mul  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
K = TritonKernels()


DTYPES = [torch.float16, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within two rounding steps of the reference, which rounds where the kernels round. The interpreter
    truncates to bf16 (CUDA rounds to nearest), so there bf16 gets four steps of the larger size."""
    step = torch.finfo(a.dtype).eps
    if a.dtype == torch.bfloat16 and not CUDA:
        step *= 2
    torch.testing.assert_close(a.float(), b.float(), rtol=2 * step, atol=2 * step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_norm(with_residual: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(DEVICE, dtype)
    norm.weight.data.normal_()
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    res = torch.randn(5, 96, device=DEVICE).to(dtype) if with_residual else None
    want, want_res = norm.forward(x, res)
    got, got_res = K.add_rms_norm(x, None if res is None else res.clone(), norm.weight, 1e-5)
    close(got, want)
    close(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    x = torch.randn(3, 2 * 1500, device=DEVICE).to(dtype)  # wider than one 1,024-column tile
    close(K.silu_and_mul(x), silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    t, d, hq, hk = 4, 64, 6, 2
    rotary = RotaryEmbedding(d, 128, 10000.0).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 5, 17, 99], device=DEVICE)
    cos, sin = rotary.tables(positions)
    want = rotary.apply(qkv[:, : (hq + hk) * d].view(t, -1, d), (cos, sin)).reshape(t, -1)
    got = qkv.clone()
    K.rotary_(got, hq + hk, d, cos.contiguous(), sin.contiguous())
    close(got[:, : (hq + hk) * d], want)
    assert torch.equal(got[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :])


def reference_attention(q, k_cache, v_cache, tables, ctx_lens, q_starts, q_lens, scale):
    """Each sequence's context read back by its block table, then SDPA with the causal offset mask."""
    hk, _, bs, d = k_cache.shape
    out = torch.zeros_like(q)
    for table, ctx, start, n in zip(tables.tolist(), ctx_lens.tolist(), q_starts.tolist(), q_lens.tolist(), strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)], device=q.device)
        keys = k_cache[:, slots // bs, slots % bs]  # [Hk, ctx, D]
        values = v_cache[:, slots // bs, slots % bs]
        mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1).float(), keys.float(), values.float(),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + n] = o.transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "ctx_lens", "sm_count"), [
    ([1, 1, 1], [9, 1, 30], None),
    ([1, 1, 7, 20], [9, 1, 30, 20], None),
    # Few (sequence, KV head) programs for many SMs: each context split into partitions of 64 keys (the
    # last ones empty for the shorter context), merged by their log-sum-exp.
    ([1, 1], [300, 150], 64),
], ids=["decode", "mixed", "split_decode"])
def test_write_kv_then_paged_attention_match_the_reference(dtype: torch.dtype, q_lens: list[int],
                                                           ctx_lens: list[int], sm_count: int | None) -> None:
    """Decode rows and prefill chunks after cached prefixes, GQA (3 query heads per KV head), head dim
    80 (padded to 128 inside the kernel), blocks of 4 scattered over the cache."""
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("the interpreter's tl.dot reads bf16 as raw bits (numpy has no bf16); fp16 takes the same path")
    torch.manual_seed(2)
    kernels = TritonKernels(sm_count) if sm_count else K
    hq, hk, d, bs = 6, 2, 80, 4
    width = max(-(-c // bs) for c in ctx_lens)
    num_blocks = width * len(ctx_lens) + 8
    k_cache = torch.randn(hk, num_blocks, bs, d, device=DEVICE).to(dtype)
    v_cache = torch.randn(hk, num_blocks, bs, d, device=DEVICE).to(dtype)
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.tensor([perm[i * width : (i + 1) * width] for i in range(len(q_lens))], dtype=torch.int32,
                          device=DEVICE)
    t = sum(q_lens)
    q = torch.randn(t, hq, d, device=DEVICE).to(dtype)
    k_new, v_new = torch.randn(t, hk, d, device=DEVICE).to(dtype), torch.randn(t, hk, d, device=DEVICE).to(dtype)
    slots, starts = [], []
    for table, ctx, n in zip(tables.tolist(), ctx_lens, q_lens, strict=True):
        starts.append(len(slots))
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
    slot_t = torch.tensor(slots, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_cache(want_k, slot_t, k_new)
    write_cache(want_v, slot_t, v_new)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    step = kernels.step_args(tables, torch.tensor(ctx_lens, **i32), torch.tensor(starts, **i32), torch.tensor(q_lens, **i32),
                       slot_t)
    kernels.write_kv(k_new, v_new, k_cache, v_cache, step)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    if sm_count:
        assert kernels.partitions(len(q_lens) * hk, width * bs, 32, DEVICE) == (5, 64)
    got = kernels.paged_attention(q, k_cache, v_cache, step, scale=0.1)
    want = reference_attention(q, want_k, want_v, tables, step.ctx_lens, step.q_starts, step.q_lens, 0.1)
    # Half precision: probabilities are rounded to the cache's dtype before the PV product (as flash
    # attention does), so a few steps of that dtype.
    tol = 1e-4 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_write_kv_skips_negative_slots_and_bad_shapes_raise() -> None:
    cache = torch.zeros(1, 2, 2, 16, device=DEVICE)
    k = torch.ones(2, 1, 16, device=DEVICE)
    K.write_kv(k, k, cache, cache.clone(), torch.tensor([-1, 3], device=DEVICE))
    assert cache.view(4, 16)[3].eq(1).all() and cache.view(4, 16)[:3].eq(0).all()
    with pytest.raises(ValueError, match="write_kv"):
        K.write_kv(k[:, :, :8], k[:, :, :8], cache, cache, torch.tensor([0, 1], device=DEVICE))
