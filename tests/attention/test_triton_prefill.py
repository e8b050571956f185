"""The Triton prefill attention kernel (rayllm/attention/triton_prefill.py) against torch SDPA.

Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1, set before the import): the same
kernel code on CPU tensors, in fp32 and fp16 (the interpreter's tl.dot reads bf16 as raw bits). On CUDA
(tests/gpu/device_run.sh runs this file natively) bf16 too; tests/gpu/test_gpu_prefill.py adds the
8B model's shapes at 8k tokens. Inputs are random. Small tiles
(16 x 16) make short sequences cross many query and key tiles, so the masked diagonal, the mask-free
middle and the window's edge all run; one case per dtype uses the shipped tile sizes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from rayllm.attention.triton import StepArgs  # noqa: E402
from rayllm.attention.triton_prefill import TILES, PrefillConfig, prefill_attention  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
SMALL = PrefillConfig(16, 16, 4, 1)


def paged_case(q_lens: list[int], ctx_lens: list[int], hq: int, hk: int, d: int, bs: int, dtype: torch.dtype,
               seed: int = 0):
    """Random caches with each sequence's blocks scattered (a permutation), queries for the last q_len
    positions of each context, laid out flat with two spare rows before each sequence's chunk."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // bs) for c in ctx_lens)
    num_blocks = width * len(ctx_lens) + 3
    k_cache = torch.randn(hk, num_blocks, bs, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(hk, num_blocks, bs, d, generator=gen).to(DEVICE, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.tensor([perm[i * width : (i + 1) * width] for i in range(len(q_lens))], dtype=torch.int32)
    starts, t = [], 0
    for n in q_lens:
        starts.append(t + 2)
        t += n + 2
    q = torch.randn(t, hq, d, generator=gen).to(DEVICE, dtype)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    step = StepArgs(tables.to(DEVICE), torch.tensor(ctx_lens, **i32), torch.tensor(starts, **i32),
                    torch.tensor(q_lens, **i32), None)
    return q, k_cache, v_cache, step


def reference(q, k_cache, v_cache, step: StepArgs, scale: float, window: int | None, softcap: float | None):
    """Each context read back through its block table, in fp32: SDPA with the causal (and window) mask, or,
    soft-capped, the explicit scores (SDPA cannot cap)."""
    hk, _, bs, d = k_cache.shape
    want = {}
    for table, ctx, start, n in zip(step.tables.tolist(), step.ctx_lens.tolist(), step.q_starts.tolist(),
                                    step.q_lens.tolist(), strict=True):
        pos = torch.arange(ctx, device=DEVICE)
        blocks = torch.tensor(table, device=DEVICE)[pos // bs]
        keys, values = k_cache[:, blocks, pos % bs].float(), v_cache[:, blocks, pos % bs].float()  # [Hk, ctx, D]
        qs = q[start : start + n].transpose(0, 1).float()  # [Hq, n, D]
        q_pos = torch.arange(ctx - n, ctx, device=DEVICE)[:, None]
        mask = pos[None, :] <= q_pos
        if window is not None:
            mask &= pos[None, :] > q_pos - window
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            group = qs.shape[0] // hk
            scores = qs @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
            scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
            o = scores.softmax(-1) @ values.repeat_interleave(group, 0)
        want[start] = o.transpose(0, 1)
    return want


def check(q_lens, ctx_lens, *, hq=4, hk=2, d=64, bs=16, dtype=torch.float32, scale=0.125, window=None, softcap=None,
          config=SMALL, seed=0) -> None:
    q, k_cache, v_cache, step = paged_case(q_lens, ctx_lens, hq, hk, d, bs, dtype, seed)
    out = torch.full_like(q, 7.0)
    got = prefill_attention(q, k_cache, v_cache, out, step, max(q_lens), scale, window, softcap, config)
    assert got is out
    tol = 2e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    rows = set()
    for start, want in reference(q, k_cache, v_cache, step, scale, window, softcap).items():
        torch.testing.assert_close(got[start : start + want.shape[0]].float(), want, rtol=tol, atol=tol)
        rows.update(range(start, start + want.shape[0]))
    others = [r for r in range(q.shape[0]) if r not in rows]
    assert got[others].eq(7.0).all()  # rows of no sequence are not written


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])  # bf16: the GPU lane


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 32, 8], ids=["tile_is_block", "two_tiles_a_block", "gathered_keys"])
def test_fresh_prompts_at_odd_lengths(dtype: torch.dtype, bs: int) -> None:
    """Whole prompts (no cached prefix): odd lengths, one shorter than a tile, one across many blocks."""
    check([37, 5, 1], [37, 5, 1], bs=bs, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_after_a_cached_prefix(dtype: torch.dtype) -> None:
    """Chunks whose first position is mid-block and mid-tile, after cached prefixes (prefix caching or an
    earlier chunk), GQA of 3 query heads per KV head, head dim 80 (padded to 128 in the kernel)."""
    check([23, 40, 1, 16], [100, 57, 33, 16], hq=6, hk=2, d=80, dtype=dtype, scale=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 7, 20, 50])
def test_sliding_windows(dtype: torch.dtype, window: int) -> None:
    """Windows narrower than a tile (7), about a tile (20), several tiles (50), and of one key (1)."""
    check([45, 30], [45, 90], window=window, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 9])
def test_soft_capped_logits(dtype: torch.dtype, window: int | None) -> None:
    """Gemma 2's cap (tanh(s / cap) * cap) on logits large enough that it matters, with and without its
    window; the query scale is not the head dim's."""
    check([29, 12], [29, 50], d=32, scale=0.6, softcap=4.0, window=window, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shipped_tile_sizes(dtype: torch.dtype) -> None:
    """The default tiles for the dtype (fp16: 128 x 64, fp32: 64 x 32), blocks of 64: a prompt of 150 rows
    after a 50-token prefix and a short fresh one."""
    check([150, 9], [200, 9], hq=4, hk=1, d=128, bs=64, dtype=dtype, config=None)


def test_single_query_rows_as_decode() -> None:
    """One row per sequence (windowed models' decode rows take this kernel): the 16-row config."""
    check([1, 1, 1], [70, 1, 17], window=20, config=None)


def test_bad_shapes_raise() -> None:
    q, k_cache, v_cache, step = paged_case([4], [4], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="prefill_attention"):
        prefill_attention(q[:, :3], k_cache, v_cache, torch.empty_like(q[:, :3]), step, 4)
    with pytest.raises(ValueError, match="prefill_attention"):
        prefill_attention(q.half(), k_cache, v_cache, torch.empty_like(q.half()), step, 4)


WIDE_TILES = [(fp32, cfg) for (fp32, wide, _), choices in TILES.items() if wide for cfg, _ in choices]


@pytest.mark.parametrize("fp32,config", WIDE_TILES, ids=[f"{'fp32' if f else 'fp16'}-{c}" for f, c in WIDE_TILES])
def test_head_dim_256_tiles(fp32: bool, config: PrefillConfig) -> None:
    """Gemma's head dim (256) with every tile choice a device may get for it (TILES: two stages where the
    shared memory allows, one on sm_86 / sm_89), blocks of 64; then soft-capped and windowed as Gemma 2."""
    dtype = torch.float32 if fp32 else torch.float16
    check([70, 9], [120, 9], hq=2, hk=1, d=256, bs=64, dtype=dtype, scale=0.0625, config=config)
    check([40], [100], hq=2, hk=1, d=256, bs=64, dtype=dtype, scale=0.0625, softcap=50.0, window=30, config=config)
