"""The C paged kernels (rayllm/platforms/cpu/csrc) agree with the torch paths they replace."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from rayllm.attention.base import AttentionMetadata, decode_gather_index, write_cache
from rayllm.attention.sdpa import decode_attention
from rayllm.platforms.cpu import kernels as cpu_kernels


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.PagedKernels:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the paged kernels")
    loaded = cpu_kernels.load()
    assert loaded is not None
    return loaded


def scattered_batch(batch: int, max_len: int, hk: int, d: int, num_blocks: int, bs: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(hk, num_blocks, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(hk, num_blocks, bs, d, generator=g).to(dtype)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0], lens[-1] = 1, bs  # a one-token context and one that ends on a block boundary
    width = -(-int(lens.max()) // bs)
    tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    return k_cache, v_cache, lens, tables


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("threads", [1, 2])
# SmolLM2's heads (9 over 3 KV heads of 64), Llama-3's (4 per KV head of 128), no GQA, a head dim
# that the specialised bf16 kernel leaves to the generic one, and a larger block.
@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 32), (6, 2, 96, 16)])
def test_decode_kernel_equals_torch_decode(kernels, dtype, atol, threads, hq, hk, d, bs):
    num_blocks, batch = 200, 24
    k_cache, v_cache, lens, tables = scattered_batch(batch, 130, hk, d, num_blocks, bs, dtype, seed=1)
    q = torch.randn(batch, hq, d).to(dtype)
    width = tables.shape[1]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long), num_decode=batch, block_size=bs,
        decode_mask=torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1),
        decode_gather_index=decode_gather_index(tables, hk, num_blocks),
    )
    # The reference in fp32, whatever the cache dtype: the kernel accumulates in fp32.
    expected = decode_attention(q.float(), k_cache.float(), v_cache.float(), meta)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.paged_attention(q, k_cache, v_cache, tables, lens)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


def causal_reference(q, k, v, start):
    """fp32 attention of query rows at positions start.. over keys 0..their own position."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / q.shape[-1] ** 0.5
    pos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (8, 2, 128), (6, 2, 96)])
def test_prefill_chunks_and_decode_rows_in_one_call(kernels, dtype, atol, hq, hk, d):
    """One kernel call for a whole mixed step: decode rows, a fresh 50-token prompt, and a 37-token
    chunk after a 20-token cached prefix (more rows than one work tile), in flat order."""
    bs, num_blocks = 16, 64
    g = torch.Generator().manual_seed(7)
    k_cache = torch.randn(hk, num_blocks, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(hk, num_blocks, bs, d, generator=g).to(dtype)
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    # (context after this step, rows computed now)
    seqs = [(33, 1), (5, 1), (50, 50), (57, 37)]
    tables, starts, rows = [], [], 0
    for ctx, n in seqs:
        tables.append([blocks.pop() for _ in range(-(-ctx // bs))])
        starts.append(rows)
        rows += n
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    i32 = dict(dtype=torch.int32)
    got = kernels.paged_attention(q, k_cache, v_cache, tables_t, torch.tensor([c for c, _ in seqs], **i32),
                                  torch.tensor(starts, **i32), torch.tensor([n for _, n in seqs], **i32))
    assert got.shape == q.shape and got.dtype == dtype
    for (ctx, n), table, start in zip(seqs, tables, starts, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
        k = k_cache[:, slots // bs, slots % bs].transpose(0, 1)
        v = v_cache[:, slots // bs, slots % bs].transpose(0, 1)
        want = causal_reference(q[start : start + n], k, v, ctx - n)
        torch.testing.assert_close(got[start : start + n].float(), want, atol=atol, rtol=atol)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_torch_write(kernels, dtype):
    hk, d, bs, num_blocks, t = 3, 64, 16, 40, 37
    slots = torch.randperm(num_blocks * bs)[:t]
    k, v = torch.randn(t, hk, d).to(dtype), torch.randn(t, hk, d).to(dtype)
    ours = [torch.randn(hk, num_blocks, bs, d).to(dtype) for _ in range(2)]
    ref = [c.clone() for c in ours]
    kernels.write_kv(k, v, ours[0], ours[1], slots)
    write_cache(ref[0], slots, k)
    write_cache(ref[1], slots, v)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])  # copies: bit-exact


def test_build_is_cached_per_source(tmp_path):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    # Unoptimised: the caching is the same at any flags, and -O0 compiles in a fifth of -O3's time (the suite's
    # kernels fixture builds the real flags).
    flags = ["-O0" if f == "-O3" else f for f in cpu_kernels.CFLAGS]
    first = cpu_kernels.build(tmp_path, flags)
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(tmp_path, flags) == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left behind


def test_without_a_compiler_the_torch_path_is_used(monkeypatch, tmp_path):
    from rayllm.attention.selector import make_attention_backend

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("RAYLLM_KERNEL_CACHE", str(tmp_path / "cache"))  # nothing cached to reuse
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert make_attention_backend("auto", torch.device("cpu")).kernels is None
    finally:
        cpu_kernels.load.cache_clear()


def bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step (the kernels may fuse a multiply-add that torch rounds twice)."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1 / 128)


@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_rms_norm_equals_rmsnorm_module(kernels, with_residual):
    from rayllm.layers.basic import RMSNorm

    torch.manual_seed(0)
    ref = RMSNorm(576, 1e-5).to(torch.bfloat16)
    ref.weight.data.normal_(1.0, 0.2)
    x = torch.randn(7, 576).to(torch.bfloat16)
    residual = torch.randn(7, 576).to(torch.bfloat16) if with_residual else None
    want_normed, want_residual = ref(x, residual)
    got_normed, got_residual = kernels.add_rms_norm(x, residual.clone() if with_residual else None, ref.weight,
                                                    1e-5)
    assert torch.equal(got_residual, want_residual)  # one bf16 add, rounded the same way
    bf16_close(got_normed, want_normed)


def test_fused_silu_and_mul_equals_torch(kernels):
    from rayllm.layers.basic import silu_and_mul

    x = (torch.randn(5, 2 * 1536) * 4).to(torch.bfloat16)
    bf16_close(kernels.silu_and_mul(x), silu_and_mul(x))


def test_rotary_in_place_equals_rotary_module(kernels):
    from rayllm.layers.basic import RotaryEmbedding

    rotary = RotaryEmbedding(64, 2048, 10000.0)
    t, hq, hk = 6, 9, 3
    qkv = torch.randn(t, (hq + 2 * hk) * 64).to(torch.bfloat16)
    tables = rotary.tables(torch.tensor([0, 1, 5, 17, 300, 2047]))
    want = rotary.apply(qkv[:, : (hq + hk) * 64].view(t, -1, 64), tables)
    got = qkv.clone()
    kernels.rotary_(got, hq + hk, 64, *tables)
    bf16_close(got[:, : (hq + hk) * 64].view(t, -1, 64), want)
    assert torch.equal(got[:, (hq + hk) * 64 :], qkv[:, (hq + hk) * 64 :])  # v heads untouched


def test_strided_views_of_qkv_are_read_in_place(kernels):
    """q/k/v as views into one fused qkv row (no copies) give what contiguous copies give."""
    hq, hk, d, bs, num_blocks, batch = 9, 3, 64, 16, 64, 5
    k_cache, v_cache, lens, tables = scattered_batch(batch, 60, hk, d, num_blocks, bs, torch.bfloat16, seed=3)
    qkv = torch.randn(batch, (hq + 2 * hk) * d).to(torch.bfloat16)
    q = qkv[:, : hq * d].view(batch, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(batch, hk, d)
    v = qkv[:, (hq + hk) * d :].view(batch, hk, d)
    slots = (tables[:, 0].long() * bs)  # each sequence's first slot
    caches = [c.clone() for c in (k_cache, v_cache)]
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    kernels.write_kv(k.contiguous(), v.contiguous(), caches[0], caches[1], slots)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    assert torch.equal(kernels.paged_attention(q, k_cache, v_cache, tables, lens),
                       kernels.paged_attention(q.contiguous(), k_cache, v_cache, tables, lens))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the portable build is checked on x86-64")
def test_portable_build_without_avx512_agrees_too(tmp_path):
    """CPUs without AVX-512 BF16 get the plain C paths; they must give the same answers."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    portable = cpu_kernels.PagedKernels(cpu_kernels.build(tmp_path, ["-O3", "-march=x86-64-v2", "-fopenmp", "-shared",
                                                                     "-fPIC", "-std=gnu11"]))
    assert not portable.vectorized
    k_cache, v_cache, lens, tables = scattered_batch(6, 70, 3, 64, 40, 16, torch.bfloat16, seed=5)
    q = torch.randn(6, 9, 64).to(torch.bfloat16)
    native = cpu_kernels.load()
    if native is not None:
        torch.testing.assert_close(portable.paged_attention(q, k_cache, v_cache, tables, lens).float(),
                                   native.paged_attention(q, k_cache, v_cache, tables, lens).float(),
                                   atol=2e-2, rtol=2e-2)
    from rayllm.layers.basic import RMSNorm, silu_and_mul

    x = (torch.randn(3, 2 * 96) * 3).to(torch.bfloat16)
    bf16_close(portable.silu_and_mul(x), silu_and_mul(x))
    norm = RMSNorm(96, 1e-5).to(torch.bfloat16)
    h, r = torch.randn(3, 96).to(torch.bfloat16), torch.randn(3, 96).to(torch.bfloat16)
    want = norm(h, r)
    got = portable.add_rms_norm(h, r.clone(), norm.weight, 1e-5)
    bf16_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("rows,vocab", [(64, 49152), (3, 17), (2, 7), (5, 49153)])
def test_argmax_of_bf16_rows_equals_torch(kernels, rows, vocab):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
    x[0, vocab // 3] = x[0, vocab // 2] = x[0].max() + 1  # a tie: the first index wins, as in torch
    x[-1, -1] = x[-1].max() + 1  # the largest in the scalar tail
    assert torch.equal(kernels.argmax(x), x.float().argmax(-1))
    assert torch.equal(kernels.argmax(x[:, : vocab - 1]), x[:, : vocab - 1].float().argmax(-1))  # strided rows


def test_argmax_handles_infinities_and_nan_as_torch(kernels):
    x = torch.full((3, 100), float("-inf"), dtype=torch.bfloat16)
    x[1, 50] = x[1, 70] = float("nan")
    x[2, 99] = float("inf")
    assert torch.equal(kernels.argmax(x), x.float().argmax(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_row_kernels_split_across_threads_agree(kernels, threads):
    """Enough rows that norm, SiLU and rotary split them across threads: same results as torch."""
    from rayllm.layers.basic import RMSNorm, RotaryEmbedding, silu_and_mul

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1)
        t = 37
        x = (torch.randn(t, 2 * 256) * 4).to(torch.bfloat16)
        bf16_close(kernels.silu_and_mul(x), silu_and_mul(x))
        norm = RMSNorm(128, 1e-5).to(torch.bfloat16)
        h, r = torch.randn(t, 128).to(torch.bfloat16), torch.randn(t, 128).to(torch.bfloat16)
        want_normed, want_residual = norm(h, r)
        got_normed, got_residual = kernels.add_rms_norm(h, r.clone(), norm.weight, 1e-5)
        assert torch.equal(got_residual, want_residual)
        bf16_close(got_normed, want_normed)
        rotary = RotaryEmbedding(128, 512, 10000.0)
        qkv = torch.randn(t, 5 * 128).to(torch.bfloat16)
        tables = rotary.tables(torch.arange(100, 100 + t))
        got = qkv.clone()
        kernels.rotary_(got, 4, 128, *tables)
        bf16_close(got[:, : 4 * 128].view(t, 4, 128), rotary.apply(qkv[:, : 4 * 128].view(t, 4, 128), tables))
    finally:
        torch.set_num_threads(before)


# ---- Bad inputs raise ValueError at the boundary (or from the C kernels' own index checks) instead of
# reading or writing outside the buffers. Each case is a valid call with one thing broken.

def attention_case(dtype=torch.float32):
    hq, hk, d, bs, num_blocks, batch = 4, 2, 64, 16, 32, 3
    k_cache, v_cache, lens, tables = scattered_batch(batch, 40, hk, d, num_blocks, bs, dtype, seed=11)
    q = torch.randn(batch, hq, d).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, ctx_lens=lens)


def test_valid_attention_inputs_pass_the_checks_with_unused_table_entries_as_padding(kernels):
    case = attention_case()
    want = kernels.paged_attention(**case)
    tables = case["block_tables"].clone()
    used = -(-case["ctx_lens"] // 16)
    for s in range(tables.shape[0]):
        tables[s, int(used[s]):] = 2**30  # entries past a sequence's context are never read
    assert torch.equal(kernels.paged_attention(**(case | {"block_tables": tables})), want)


def _broken_attention_cases():
    def table_entry(value):
        def f(c):
            c["block_tables"] = c["block_tables"].clone()
            c["block_tables"][1, 0] = value
        return f

    def ctx_beyond_table(c):
        c["ctx_lens"] = c["ctx_lens"].clone()
        c["ctx_lens"][0] = c["block_tables"].shape[1] * 16 + 1

    yield "block entry >= num_blocks", table_entry(32), "block table"
    yield "negative block entry", table_entry(-1), "block table"
    yield "context longer than its table", ctx_beyond_table, "inconsistent"
    yield "query rows past q", lambda c: c.update(q_starts=torch.tensor([0, 1, 3], dtype=torch.int32),
                                                  q_lens=torch.ones(3, dtype=torch.int32)), "inconsistent"
    yield "more query rows than context", lambda c: c.update(q_starts=torch.zeros(3, dtype=torch.int32),
                                                             q_lens=c["ctx_lens"] + 1), "inconsistent"
    yield "int64 block table", lambda c: c.update(block_tables=c["block_tables"].long()), "block_tables"
    yield "strided block table", lambda c: c.update(block_tables=c["block_tables"].t().contiguous().t()), \
        "block_tables"
    yield "int64 lengths", lambda c: c.update(ctx_lens=c["ctx_lens"].long()), "ctx_lens"
    yield "lengths of another batch", lambda c: c.update(ctx_lens=c["ctx_lens"][:2]), "block_tables"
    yield "q dtype differs from the cache", lambda c: c.update(q=c["q"].double()), "q must be"
    yield "head dim differs from the cache", lambda c: c.update(q=c["q"][..., :32]), "q must be"
    yield "query heads not a multiple of KV heads", lambda c: c.update(q=torch.randn(3, 3, 64)), "q must be"
    yield "non-contiguous cache", lambda c: c.update(k_cache=c["k_cache"].transpose(1, 2)), "caches"


BROKEN_ATTENTION = list(_broken_attention_cases())


@pytest.mark.parametrize("breaks,message", [c[1:] for c in BROKEN_ATTENTION], ids=[c[0] for c in BROKEN_ATTENTION])
def test_paged_attention_refuses_inputs_it_cannot_index(kernels, breaks, message):
    case = attention_case()
    breaks(case)
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**case)


def test_write_kv_refuses_out_of_range_slots_and_writes_nothing(kernels):
    hk, nb, bs, d = 2, 8, 16, 64
    k_cache, v_cache = torch.zeros(hk, nb, bs, d), torch.zeros(hk, nb, bs, d)
    k, v = torch.randn(3, hk, d), torch.randn(3, hk, d)
    with pytest.raises(ValueError, match="slot"):
        kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 5, nb * bs]))
    assert not k_cache.any() and not v_cache.any()
    kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([0, -1, nb * bs - 1]))  # -1: padding, skipped
    assert torch.equal(k_cache[:, -1, -1], k[2]) and not k_cache[:, 0, 1:].any()
    for slots, kk, vv, message in [
        (torch.tensor([0, 1, 2], dtype=torch.int32), k, v, "slots"),
        (torch.tensor([0, 1]), k, v, "slots"),
        (torch.tensor([0, 1, 2]), k[:, :1], v[:, :1], "k and v"),
        (torch.tensor([0, 1, 2]), k.to(torch.bfloat16), v.to(torch.bfloat16), "k and v"),
    ]:
        with pytest.raises(ValueError, match=message):
            kernels.write_kv(kk, vv, k_cache, v_cache, slots)


def test_row_kernels_refuse_bad_shapes_and_unsupported_head_dims(kernels):
    from rayllm.layers.basic import RotaryEmbedding

    qkv = torch.randn(2, 4 * 576).to(torch.bfloat16)
    big = RotaryEmbedding(576, 64, 10000.0).tables(torch.arange(2))
    with pytest.raises(ValueError, match="head dim 576"):  # the kernel's stack buffer holds 512
        kernels.rotary_(qkv, 4, 576, *big)
    tables = RotaryEmbedding(64, 64, 10000.0).tables(torch.arange(2))
    with pytest.raises(ValueError, match="qkv"):
        kernels.rotary_(torch.randn(2, 64).to(torch.bfloat16), 4, 64, *tables)  # fewer columns than heads
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.rotary_(torch.randn(3, 4 * 64).to(torch.bfloat16), 4, 64, *tables)  # tables of 2 rows for 3
    with pytest.raises(ValueError, match="argmax"):
        kernels.argmax(torch.randn(2, 10))
    with pytest.raises(ValueError, match="silu_and_mul"):
        kernels.silu_and_mul(torch.randn(2, 7).to(torch.bfloat16))
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        kernels.add_rms_norm(x, None, torch.ones(32, dtype=torch.bfloat16), 1e-5)
