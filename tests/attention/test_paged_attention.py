"""Paged attention over scattered cache blocks equals dense causal attention."""

from __future__ import annotations

import shutil

import pytest
import torch

from rayllm.attention.sdpa import SDPAAttention
from rayllm.platforms.cpu import kernels as cpu_kernels
from rayllm.runner.model_runner import ModelRunner
from rayllm.schema.step import SeqStep, StepInput


def dense_attention(q, k, v):
    """q: [n, Hq, D], k/v: [n, Hk, D]; plain causal attention with repeated KV heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


def backend(kind: str) -> SDPAAttention:
    if kind == "torch":
        return SDPAAttention()
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the paged kernels")
    kernels = cpu_kernels.load()
    assert kernels is not None  # a compiler is here, so the build must work
    return SDPAAttention(kernels)


@pytest.mark.parametrize("kind", ["torch", "c_kernels"])
def test_paged_equals_dense_for_prefill_chunks_and_decode(kind):
    torch.manual_seed(0)
    hq, hk, d, bs = 4, 2, 8, 4
    num_blocks = 32
    k_cache = torch.randn(hk, num_blocks, bs, d)  # garbage in unused slots must not leak in
    v_cache = torch.randn(hk, num_blocks, bs, d)
    runner = ModelRunner(model=None, kv_caches=[(k_cache, v_cache)], block_size=bs, vocab_size=10, device=torch.device("cpu"),
                         is_driver=True)
    attn = backend(kind)
    lengths = [13, 7, 1]
    tables = [[9, 3, 27, 14], [5, 20], [31]]  # deliberately scattered blocks
    full = [(torch.randn(n, hq, d), torch.randn(n, hk, d), torch.randn(n, hk, d)) for n in lengths]
    expected = [dense_attention(*x) for x in full]
    # Prefill sequence 0 in two chunks (5 then 8 tokens), the others at once, then check every output.
    chunks = [(0, 0, 5), (1, 0, 7), (2, 0, 1), (0, 5, 13)]
    for seq, start, end in chunks:
        step = StepInput([SeqStep(f"s{seq}", [0] * (end - start), start, tables[seq], sample=False)])
        _, _, meta = runner.prepare(step)
        q, k, v = (t[start:end] for t in full[seq])
        out = attn(q, k, v, k_cache, v_cache, meta)
        torch.testing.assert_close(out, expected[seq][start:end], atol=1e-5, rtol=1e-5)
    # A decode step for all three sequences together (one new token each), batched.
    new = [(torch.randn(1, hq, d), torch.randn(1, hk, d), torch.randn(1, hk, d)) for _ in lengths]
    # No length is a multiple of the block size, so each new token fits the sequence's last block.
    steps = [SeqStep(f"s{i}", [0], lengths[i], tables[i], sample=True) for i in range(3)]
    _, _, meta = runner.prepare(StepInput(steps))
    assert meta.num_decode == 3
    q = torch.cat([x[0] for x in new])
    k = torch.cat([x[1] for x in new])
    v = torch.cat([x[2] for x in new])
    out = attn(q, k, v, k_cache, v_cache, meta)
    for i in range(3):
        qf, kf, vf = (torch.cat([full[i][j], new[i][j]]) for j in range(3))
        torch.testing.assert_close(out[i], dense_attention(qf, kf, vf)[-1], atol=1e-5, rtol=1e-5)
