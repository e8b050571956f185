"""The xformers backend's glue (paged biases over the block-major cache, block tables, offsets, GQA
grouping, the gathered fallback) on CPU.

xformers has no CPU ops and needs CUDA, which this machine lacks, so `xformers.ops.fmha` is replaced by a
CPU stand-in that computes what xformers documents for memory_efficient_attention_forward with its
PagedBlockDiagonalCausalWithOffsetPaddedKeysMask (K/V [1, pages * page_size, G, H, D]; sequence b reads
logical key j from page block_tables[b, j // page_size]; query i of a q_len-row block attends keys
j <= i + kv_len - q_len) and its BlockDiagonalCausalFromBottomRightMask (the gathered fallback). The
stand-in reads the bias's tensors (what the CUDA kernels read), and checks the Python-side fields agree.
It can refuse what a given xformers build refuses (its split-k kernel: paged steps of equal query
lengths <= 16 only), so the fallbacks run too. Everything of ours around the call runs for real, and
must equal the SDPA backend. Backend selection is checked with a CUDA *device object* (no CUDA touched).
"""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from model_parallel.attention import SDPAAttention, XformersAttention, make_attention_backend
from model_parallel.model_runner import ModelRunner, SeqStep, StepInput


@dataclass
class _SeqLenInfo:  # xformers.ops.fmha.attn_bias._SeqLenInfo's fields
    seqstart: torch.Tensor
    max_seqlen: int
    min_seqlen: int
    seqstart_py: list[int]


@dataclass
class _PaddedSeqLenInfo(_SeqLenInfo):
    seqlen: torch.Tensor
    seqlen_py: list[int]
    padding: int


@dataclass
class _PagedCausalMask:  # PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    block_tables: torch.Tensor
    page_size: int


class _BottomRightMask:
    def __init__(self, q_lens: list[int], kv_lens: list[int]) -> None:
        self.q_lens, self.kv_lens = q_lens, kv_lens

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int]) -> _BottomRightMask:
        return cls(list(q_seqlen), list(kv_seqlen))


def _attend(qs, ks, vs):
    """[ql, G, H, K] queries over [kl, G, H, K] keys, causal aligned bottom-right."""
    ql, kl = qs.shape[0], ks.shape[0]
    scores = torch.einsum("qghd,kghd->ghqk", qs, ks) * qs.shape[-1] ** -0.5
    allowed = torch.arange(kl)[None, :] <= (torch.arange(ql)[:, None] + kl - ql)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("ghqk,kghd->qghd", probs, vs)


class FakeFmha:
    def __init__(self, refuse: str = "") -> None:
        self.refuse = refuse  # "": every paged step; "splitk": equal q lengths <= 16 only; "all": none
        self.calls: list[str] = []
        self.attn_bias = types.SimpleNamespace(
            _SeqLenInfo=_SeqLenInfo, _PaddedSeqLenInfo=_PaddedSeqLenInfo,
            PagedBlockDiagonalCausalWithOffsetPaddedKeysMask=_PagedCausalMask,
            BlockDiagonalCausalFromBottomRightMask=_BottomRightMask)

    def memory_efficient_attention_forward(self, q, k, v, attn_bias):
        if isinstance(attn_bias, _PagedCausalMask):
            return self._paged(q, k, v, attn_bias)
        self.calls.append("gathered")
        out = torch.empty_like(q)
        qo = ko = 0
        for ql, kl in zip(attn_bias.q_lens, attn_bias.kv_lens, strict=True):
            out[0, qo:qo + ql] = _attend(q[0, qo:qo + ql], k[0, ko:ko + kl], v[0, ko:ko + kl])
            qo, ko = qo + ql, ko + kl
        return out

    def _paged(self, q, k, v, bias: _PagedCausalMask):
        qi, ki, ps = bias.q_seqinfo, bias.k_seqinfo, bias.page_size
        if self.refuse == "all" or (self.refuse == "splitk" and (qi.min_seqlen != qi.max_seqlen or qi.max_seqlen > 16)):
            raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs: ...")
        self.calls.append("paged")
        starts, lens = qi.seqstart.tolist(), ki.seqlen.tolist()
        assert starts == qi.seqstart_py and starts[-1] == q.shape[1] and lens == ki.seqlen_py
        assert bias.block_tables.dtype == torch.int32 and ki.padding == bias.block_tables.shape[1] * ps
        assert ki.seqstart.tolist() == ki.seqstart_py == [b * ki.padding for b in range(len(lens) + 1)]
        assert k.shape[1] % ps == 0 and max(lens) <= ki.padding
        out = torch.empty_like(q)
        for b, kl in enumerate(lens):
            logical = torch.arange(kl)
            rows = bias.block_tables[b].long()[logical // ps] * ps + logical % ps
            out[0, starts[b]:starts[b + 1]] = _attend(q[0, starts[b]:starts[b + 1]], k[0, rows], v[0, rows])
        return out


@pytest.fixture
def fake_xformers(monkeypatch):
    def install(refuse: str = "") -> FakeFmha:
        fmha = FakeFmha(refuse)
        ops = types.ModuleType("xformers.ops")
        ops.fmha = fmha  # type: ignore[attr-defined]
        pkg = types.ModuleType("xformers")
        pkg.ops = ops  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "xformers", pkg)
        monkeypatch.setitem(sys.modules, "xformers.ops", ops)
        return fmha

    return install


STEPS_TABLES = [[9, 3, 27, 14], [5, 20, 11], [31]]  # deliberately scattered blocks


def _steps():
    t = STEPS_TABLES
    # Mixed steps: a decode row beside prefill chunks, one chunk continuing a cached prefix; then decode.
    return [
        [SeqStep("a", [0] * 5, 0, t[0], sample=False), SeqStep("b", [0] * 7, 0, t[1], sample=True)],
        [SeqStep("b", [0], 7, t[1], sample=True), SeqStep("a", [0] * 8, 5, t[0], sample=True),
         SeqStep("c", [0] * 2, 0, t[2], sample=True)],
        [SeqStep("a", [0], 13, t[0], sample=True), SeqStep("b", [0], 8, t[1], sample=True),
         SeqStep("c", [0], 2, t[2], sample=True)],
    ]


@pytest.mark.parametrize("refuse", ["", "splitk", "all"])
def test_xformers_glue_equals_sdpa_on_chunked_prefill_and_decode(fake_xformers, refuse):
    fmha = fake_xformers(refuse)
    torch.manual_seed(0)
    hq, hk, d, bs, num_blocks = 6, 2, 8, 4, 32
    head_major = (torch.randn(hk, num_blocks, bs, d), torch.randn(hk, num_blocks, bs, d))
    # The same contents in xformers' block-major layout [blocks, block_size, Hk, D].
    block_major = tuple(c.permute(1, 2, 0, 3).contiguous() for c in head_major)
    backends = {"sdpa": SDPAAttention(), "xformers": XformersAttention()}
    caches = {"sdpa": head_major, "xformers": block_major}
    runners = {name: ModelRunner(model=types.SimpleNamespace(attn_backend=attn), kv_caches=[caches[name]],
                                 block_size=bs, vocab_size=10, device=torch.device("cpu"), is_driver=True)
               for name, attn in backends.items()}
    expected_calls = {"": [["paged"], ["paged"], ["paged"]],  # one call per layer per step
                      "splitk": [["gathered"], ["paged", "gathered"], ["paged"]],
                      "all": [["gathered"], ["gathered"], ["gathered"]]}[refuse]
    for seqs, calls in zip(_steps(), expected_calls, strict=True):
        t = sum(len(s.token_ids) for s in seqs)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
        outs = {}
        for name, attn in backends.items():
            _, _, meta = runners[name].prepare(StepInput(seqs))
            fmha.calls.clear()
            outs[name] = attn(q, k, v, *caches[name], meta)
        torch.testing.assert_close(outs["xformers"], outs["sdpa"], atol=1e-5, rtol=1e-5)
        # Once refused, a kind of paged call is not tried again (the refusals are not counted).
        assert fmha.calls == calls
    for sdpa_cache, xf_cache in zip(head_major, block_major, strict=True):  # new K/V written to the same slots
        torch.testing.assert_close(xf_cache.permute(2, 0, 1, 3), sdpa_cache)


def test_paged_bias_is_built_once_per_step(fake_xformers):
    fmha = fake_xformers()
    built = []
    attn = XformersAttention()
    original = attn.paged_bias
    attn.paged_bias = lambda *a: built.append(1) or original(*a)  # type: ignore[method-assign]
    caches = (torch.randn(32, 4, 2, 8), torch.randn(32, 4, 2, 8))
    runner = ModelRunner(model=types.SimpleNamespace(attn_backend=attn), kv_caches=[caches], block_size=4,
                         vocab_size=10, device=torch.device("cpu"), is_driver=True)
    _, _, meta = runner.prepare(StepInput(_steps()[0]))
    for _ in range(3):  # three layers share the step's metadata
        attn(torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8), *caches, meta)
    assert built == [1] and fmha.calls == ["paged"] * 3


def test_backend_choice(fake_xformers, monkeypatch, caplog):
    fake_xformers()
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
