"""One StepArgs (cpu_kernels.step_args) serves every layer of a step: the same results as passing the
step's tensors to each call, and bad step inputs are refused before any kernel reads them."""

from __future__ import annotations

import shutil

import pytest
import torch

from rayllm.platforms.cpu import kernels as cpu_kernels


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.PagedKernels:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the paged kernels")
    loaded = cpu_kernels.load()
    assert loaded is not None
    return loaded


def step(hq: int = 9, hk: int = 3, d: int = 64, bs: int = 16, num_blocks: int = 32):
    """Two decode rows and a 3-token prefill chunk, as the model runner lays them out."""
    g = torch.Generator().manual_seed(0)
    i32 = dict(dtype=torch.int32)
    tables = torch.tensor([[3, 7, 0], [5, 0, 0], [9, 11, 12]], **i32)
    ctx_lens, q_starts, q_lens = (torch.tensor(v, **i32) for v in ([20, 4, 40], [0, 1, 2], [1, 1, 3]))
    slots = torch.tensor([7 * bs + 3, 5 * bs + 3, 12 * bs + 5, 12 * bs + 6, 12 * bs + 7])
    caches = [torch.randn(hk, num_blocks, bs, d, generator=g).to(torch.bfloat16) for _ in range(4)]  # two layers
    qkv = torch.randn(5, (hq + 2 * hk) * d, generator=g).to(torch.bfloat16).view(5, -1, d)
    return (tables, ctx_lens, q_starts, q_lens, slots), caches, qkv.split((hq, hk, hk), 1)


def test_one_step_args_for_every_layer_equals_the_tensors_per_call(kernels):
    (tables, ctx_lens, q_starts, q_lens, slots), caches, (q, k, v) = step()
    args = kernels.step_args(tables, ctx_lens, q_starts, q_lens, slots)
    expected_caches = [c.clone() for c in caches]
    for layer in range(2):
        kc, vc = caches[2 * layer : 2 * layer + 2]
        ek, ev = expected_caches[2 * layer : 2 * layer + 2]
        kernels.write_kv(k, v, kc, vc, args)
        kernels.write_kv(k, v, ek, ev, slots)
        assert torch.equal(kc, ek) and torch.equal(vc, ev)
        assert torch.equal(kernels.paged_attention(q, kc, vc, args),
                           kernels.paged_attention(q, ek, ev, tables, ctx_lens, q_starts, q_lens))


def test_bad_step_inputs_are_refused(kernels):
    (tables, ctx_lens, q_starts, q_lens, slots), caches, (q, k, v) = step()
    with pytest.raises(ValueError, match="slots"):
        kernels.step_args(tables, ctx_lens, q_starts, q_lens, slots.int())
    with pytest.raises(ValueError, match="block_tables"):
        kernels.step_args(tables.long(), ctx_lens, q_starts, q_lens, slots)
    with pytest.raises(ValueError, match="q_starts and q_lens"):
        kernels.step_args(tables, ctx_lens, q_starts[:2], q_lens, slots)
    without_slots = kernels.step_args(tables, ctx_lens, q_starts, q_lens)
    before = caches[0].clone()
    with pytest.raises(ValueError, match="slots were not given"):
        kernels.write_kv(k, v, caches[0], caches[1], without_slots)
    args = kernels.step_args(tables, ctx_lens, q_starts, q_lens, slots)
    with pytest.raises(ValueError, match=r"k and v must be \[5, 3, 64\]"):  # rows of another step
        kernels.write_kv(k[:4], v[:4], caches[0], caches[1], args)
    assert torch.equal(caches[0], before)  # nothing written
