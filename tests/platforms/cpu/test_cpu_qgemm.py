"""cpu_qgemm's int4 x int8 VNNI kernel against a reference written in torch (random weights and inputs:
this test says so). The reference quantizes each row's groups of 32 to int8 as the kernel is documented
to (scale max|x| / 127, round half to even) and sums in float64, so only the output's bf16 rounding and
float32 summation order separate the two."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from rayllm.layers import linear as parallel
from rayllm.layers.linear import PackedWeight
from rayllm.layers.linear_method import DENSE, SmallBatchMethod
from rayllm.platforms.cpu import kernels as cpu_kernels
from rayllm.platforms.cpu import qgemm as cpu_qgemm

pytestmark = pytest.mark.skipif(not cpu_qgemm.available(), reason="no AVX-512 VNNI on this CPU (or no C compiler)")


def random_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    m = -torch.rand(n, k // 32, generator=g) * 0.15
    return q, d, m


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    # The kernel stores d and m in fp16.
    w = q.double().view(n, k // 32, 32) * d.half().double()[..., None] + m.half().double()[..., None]
    xg = x.float().view(x.shape[0], k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)  # float32 throughout, as the kernel
    xq = torch.round(xg * torch.where(amax > 0, 127 / amax, 0.0))
    scale = amax / 127
    return (xq.double() * scale.double()).view(x.shape[0], k) @ w.view(n, k).T


@pytest.mark.parametrize("n,k", [(48, 64), (960, 576), (576, 1536)])
def test_kernel_equals_the_int8_reference(n, k):
    q, d, m = random_weight(n, k)
    weight = cpu_qgemm.Int4VnniWeight(q, d, m)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 16, 17, 40):  # 40: passes of 16, 16 and 8 rows over each tile
        x = torch.randn(rows, k, generator=g).bfloat16()
        got = weight(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        want = reference(x, q, d, m)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        # Against the unquantized product: the int8 activations cost ~0.5 % (relative norm).
        exact = x.double() @ (q.double().view(n, k // 32, 32) * d.half().double()[..., None]
                              + m.half().double()[..., None]).view(n, k).T
        assert (got.double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("passes", [1, 2])
def test_rows_do_not_depend_on_the_batch_or_the_thread_count(passes):
    """What batch-invariant mode rests on (it runs this kernel at every step size): a row's bits are the same
    alone, in a decode-sized batch and in a prefill chunk past layers.linear.VNNI_TOKENS rows."""
    q, d, m = random_weight(576, 1536, seed=2)
    weight = cpu_qgemm.Int4VnniWeight(q, d, m, passes=passes)
    x = torch.randn(301, 1536).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([weight(x[i : i + 1]) for i in range(x.shape[0])])
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(weight(x), alone), t
            assert torch.equal(weight(x[5:21]), alone[5:21]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("passes", [1, 2])
def test_the_kernel_pool_gives_the_same_bits_and_yields_to_a_second_caller(passes):
    """parallel.cpu.qgemm_threads: on one torch thread the tiles go in chunks to the caller and pool.c's
    helper. Each output is the same whichever thread made it. A second caller while a job runs (the other
    half of a half step) computes alone; many such calls at once from two threads still give the same bits,
    and nothing deadlocks."""
    q, d, m = random_weight(3072, 576, seed=5)
    weight = cpu_qgemm.Int4VnniWeight(q, d, m, passes=passes, zero_offset=8)
    xs = [torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16() for rows in (1, 7, 16, 64)]
    threads, before = torch.get_num_threads(), cpu_qgemm.POOL.threads
    try:
        torch.set_num_threads(1)
        cpu_qgemm.POOL.threads = 0
        alone = [weight(x) for x in xs]
        cpu_qgemm.POOL.threads = 2
        assert cpu_qgemm.POOL.for_call() == (1, 2)
        for x, want in zip(xs, alone, strict=True):
            assert torch.equal(weight(x), want)
        failures: list[int] = []

        def hammer(i: int) -> None:
            torch.set_num_threads(1)
            for j in range(200):
                k = (i + j) % len(xs)
                if not torch.equal(weight(xs[k]), alone[k]):
                    failures.append(k)

        workers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not any(w.is_alive() for w in workers) and not failures
        cpu_qgemm.POOL.paused = True  # a step in halves: each half's calls stay on its own thread
        assert cpu_qgemm.POOL.for_call() == (1, 0)
    finally:
        cpu_qgemm.POOL.threads, cpu_qgemm.POOL.paused = before, False
        torch.set_num_threads(threads)


def test_strided_rows_and_empty_batches():
    q, d, m = random_weight(64, 96, seed=3)
    weight = cpu_qgemm.Int4VnniWeight(q, d, m)
    wide = torch.randn(5, 3 * 96).bfloat16()
    part = wide[:, 96:192]  # rows 288 apart, as a slice of a fused projection's output
    assert torch.equal(weight(part), weight(part.contiguous()))
    assert weight(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 64)
    with pytest.raises(ValueError, match="bf16"):
        weight(torch.randn(2, 96))


def test_packed_weight_uses_the_kernel_for_supported_shapes_only():
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.05).bfloat16()
    packed = PackedWeight(weight, 4, vnni=True)
    assert packed.vnni is not None and packed.max_tokens == parallel.VNNI_TOKENS
    x = torch.randn(parallel.VNNI_TOKENS, 64).bfloat16()
    layer = parallel.RowParallelLinear(0, 64, 96, parallel.TPGroup()).bfloat16()
    layer.weight.data.copy_(weight)
    layer.set_method(SmallBatchMethod(packed, DENSE))
    torch.testing.assert_close(layer(x), packed.vnni(x), rtol=0, atol=0)
    exact = x.float() @ weight.float().T
    assert (packed(x).float() - exact).norm() / exact.norm() < 0.15  # the 4-bit grid, as torch's int4 copy
    # 48 inputs (not whole groups of 32): int8 per channel, for at most SMALL_BATCH_TOKENS.
    odd = PackedWeight((torch.randn(96, 48) * 0.05).bfloat16(), 4, vnni=True)
    assert odd.vnni is None and odd.bits == 8 and odd.max_tokens == parallel.SMALL_BATCH_TOKENS
    assert not cpu_qgemm.supports(40, 64) and not cpu_qgemm.supports(96, 48) and cpu_qgemm.supports(96, 64)
    # weight_only (vnni=False) keeps torch's kernel.
    assert PackedWeight(weight, 4).vnni is None


def test_the_build_without_avx512_bf16_rounds_its_output_the_same(tmp_path):
    """CPUs with VNNI but not AVX-512 BF16 (Cascade Lake, Ice Lake) round fp32 to bf16 in integers: the
    same round-to-nearest-even as the BF16 instruction, so the same bits."""
    lib = ctypes.CDLL(str(cpu_kernels.build(tmp_path, [*cpu_kernels.CFLAGS, "-mno-avx512bf16"])))
    gemm = cpu_kernels._bind(lib, "qgemm_int4_bf16", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                       ctypes.c_void_p, *[ctypes.c_int] * 7], ctypes.c_int)
    q, d, m = random_weight(960, 576, seed=4)
    weight = cpu_qgemm.Int4VnniWeight(q, d, m)
    x = torch.randn(19, 576).bfloat16() * 30  # outputs over a wide range of exponents
    out = torch.empty(19, 960, dtype=torch.bfloat16)
    assert gemm(x.data_ptr(), x.stride(0), weight.packed.data_ptr(), out.data_ptr(), 19, 960, 576, 1, 0, 1, 0) == 0
    assert torch.equal(out, weight(x))


def test_two_passes_reach_bf16_precision():
    """passes=2 adds the int8 quantization residual of each row: the product is then as close to the
    unquantized one as bf16 output rounding allows, and much closer than one pass (random data; one
    outlier channel per row, as the residual stream carries)."""
    n, k = 960, 576
    q, d, m = random_weight(n, k)
    one, two = cpu_qgemm.Int4VnniWeight(q, d, m), cpu_qgemm.Int4VnniWeight(q, d, m, passes=2)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(2))
    x[:, 7] *= 60
    x = x.bfloat16()
    exact = x.double() @ (q.double().view(n, k // 32, 32) * d.half().double()[..., None]
                          + m.half().double()[..., None]).view(n, k).T
    err = [(w(x).double() - exact).norm() / exact.norm() for w in (one, two)]
    assert err[1] < 5e-3 and err[1] < err[0] / 3, err
    assert torch.equal(two(x[:3]), two(x)[:3])  # rows still do not depend on the batch
    with pytest.raises(ValueError, match="passes"):
        cpu_qgemm.Int4VnniWeight(q, d, m, passes=3)


def test_q8_0_weights_as_two_4bit_planes():
    """Int8VnniWeight (an LM head's Q8_0 weight, here random and rounded to bf16 as the model holds it):
    the product is the Q8_0 weight's to bf16 rounding, four times closer than a per-channel int8 copy."""
    n, k = 1024, 576
    g = torch.Generator().manual_seed(3)
    groups = torch.randn(n, k // 32, 32, generator=g) * torch.rand(n, k // 32, 1, generator=g).add(0.05) * 0.1
    d = (groups.abs().amax(-1) / 127).half().float()  # Q8_0: fp16 scale, max |q| = 127
    w = ((groups / d[..., None]).round().clamp(-127, 127) * d[..., None]).view(n, k)
    weight = cpu_qgemm.Int8VnniWeight(w.bfloat16())
    x = torch.randn(5, k, generator=g).bfloat16()
    exact = x.double() @ w.double().T
    got = weight(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, n)
    err = (got.double() - exact).norm() / exact.norm()
    per_channel = PackedWeight(w.bfloat16(), 8)
    err_channel = (per_channel(x).double() - exact).norm() / exact.norm()
    assert err < 4e-3 and err < err_channel / 3, (err, err_channel)
    assert torch.equal(weight(x[:2]), got[:2])
