"""The xformers backend's glue (varlen layout, paged context gather, GQA grouping, mask choice) on CPU.

xformers has no CPU ops and needs CUDA, which this machine lacks, so `xformers.ops.fmha` is replaced by a
CPU stand-in that computes exactly what xformers documents for memory_efficient_attention_forward with
a BlockDiagonalCausalFromBottomRightMask. Everything of ours around that call runs for real, and must
equal the SDPA backend. Backend selection is checked with a CUDA *device object* (no CUDA is touched).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from model_parallel.attention import SDPAAttention, XformersAttention, make_attention_backend
from model_parallel.model_runner import ModelRunner, SeqStep, StepInput


class _BottomRightMask:
    def __init__(self, q_lens: list[int], kv_lens: list[int]) -> None:
        self.q_lens, self.kv_lens = q_lens, kv_lens

    window: int | None = None

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int]) -> _BottomRightMask:
        return cls(list(q_seqlen), list(kv_seqlen))


class _LocalBottomRightMask(_BottomRightMask):
    """BlockDiagonalCausalLocalAttentionFromBottomRightMask: also q - window < k (xformers' docs)."""

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int], window_size: int) -> _LocalBottomRightMask:
        mask = cls(list(q_seqlen), list(kv_seqlen))
        mask.window = window_size
        return mask


def _reference_forward(q, k, v, attn_bias, scale=None):
    """[1, M, G, H, K] query / [1, N, G, H, K] key-value; per sequence, causal aligned bottom-right."""
    out = torch.empty_like(q)
    qo = ko = 0
    for ql, kl in zip(attn_bias.q_lens, attn_bias.kv_lens, strict=True):
        qs, ks, vs = q[0, qo:qo + ql], k[0, ko:ko + kl], v[0, ko:ko + kl]  # [n, G, H, K]
        scores = torch.einsum("qghd,kghd->ghqk", qs, ks) * (qs.shape[-1] ** -0.5 if scale is None else scale)
        q_pos = torch.arange(ql)[:, None] + kl - ql
        allowed = torch.arange(kl)[None, :] <= q_pos
        if attn_bias.window is not None:
            allowed &= torch.arange(kl)[None, :] > q_pos - attn_bias.window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[0, qo:qo + ql] = torch.einsum("ghqk,kghd->qghd", probs, vs)
        qo, ko = qo + ql, ko + kl
    return out


@pytest.fixture
def fake_xformers(monkeypatch):
    fmha = types.SimpleNamespace(attn_bias=types.SimpleNamespace(
        BlockDiagonalCausalFromBottomRightMask=_BottomRightMask,
        BlockDiagonalCausalLocalAttentionFromBottomRightMask=_LocalBottomRightMask),
                                 memory_efficient_attention_forward=_reference_forward)
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha  # type: ignore[attr-defined]
    pkg = types.ModuleType("xformers")
    pkg.ops = ops  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "xformers", pkg)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)


# Per-layer options: a sliding window (local mask), a custom scale, soft-capped logits (torch path).
@pytest.mark.parametrize("options", [{}, {"window": 3, "scale": 0.3}, {"softcap": 2.0}, {"window": 5, "softcap": 1.5}])
def test_xformers_glue_equals_sdpa_on_chunked_prefill_and_decode(fake_xformers, options):
    torch.manual_seed(0)
    hq, hk, d, bs, num_blocks = 6, 2, 8, 4, 32
    caches = {name: (torch.randn(hk, num_blocks, bs, d), torch.randn(hk, num_blocks, bs, d))
              for name in ("sdpa", "xformers")}
    caches["xformers"] = (caches["sdpa"][0].clone(), caches["sdpa"][1].clone())
    backends = {"sdpa": SDPAAttention(), "xformers": XformersAttention()}
    runners = {name: ModelRunner(model=None, kv_caches=[caches[name]], block_size=bs, vocab_size=10,
                                 device=torch.device("cpu"), is_driver=True) for name in backends}
    runners["xformers"].needs_context_slots = True  # what the worker sets for a varlen backend
    tables = [[9, 3, 27, 14], [5, 20, 11], [31]]  # deliberately scattered blocks
    # Mixed steps: a decode row beside prefill chunks, one chunk continuing a cached prefix.
    steps = [
        [SeqStep("a", [0] * 5, 0, tables[0], sample=False), SeqStep("b", [0] * 7, 0, tables[1], sample=True)],
        [SeqStep("b", [0], 7, tables[1], sample=True), SeqStep("a", [0] * 8, 5, tables[0], sample=True),
         SeqStep("c", [0] * 2, 0, tables[2], sample=True)],
        [SeqStep("a", [0], 13, tables[0], sample=True), SeqStep("b", [0], 8, tables[1], sample=True),
         SeqStep("c", [0], 2, tables[2], sample=True)],
    ]
    for seqs in steps:
        t = sum(len(s.token_ids) for s in seqs)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
        outs = {}
        for name, attn in backends.items():
            _, _, meta = runners[name].prepare(StepInput(seqs))
            outs[name] = attn(q, k, v, *caches[name], meta, **options)
        torch.testing.assert_close(outs["xformers"], outs["sdpa"], atol=1e-5, rtol=1e-5)


def test_backend_choice(fake_xformers, monkeypatch, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert make_attention_backend("auto", cpu).name == "sdpa"
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("xformers", cpu)
    assert make_attention_backend("auto", cuda).name == "xformers"
    assert make_attention_backend("sdpa", cuda).name == "sdpa"
    # xformers present but unloadable (built for another torch/CUDA): auto falls back, and says so.
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    with caplog.at_level(logging.WARNING, logger="model_parallel.attention"):
        assert make_attention_backend("auto", cuda).name == "sdpa"
    assert "xformers unavailable" in caplog.text
    with pytest.raises(ImportError):
        make_attention_backend("xformers", cuda)
