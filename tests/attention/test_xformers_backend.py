"""The xformers backend's glue (paged biases over the block-major cache, block tables, offsets, GQA
grouping, the gathered fallback) on CPU.

xformers has no CPU ops and needs CUDA, which this machine lacks, so `xformers.ops.fmha` is replaced by
the CPU stand-in in xformers_standin.py, which computes what xformers documents for its paged and
bottom-right causal biases and can refuse what a given build refuses, so the fallbacks run too.
Everything of ours around the call runs for real, and must equal the SDPA backend. Backend selection is checked with a CUDA *device object* (no CUDA touched).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from xformers_standin import install_fake_xformers  # tests/ is on sys.path under pytest (its conftest)

from rayllm.attention.registry import BACKENDS
from rayllm.attention.sdpa import SDPAAttention
from rayllm.attention.selector import make_attention_backend
from rayllm.attention.xformers import XformersAttention
from rayllm.engine.block_manager import FREED
from rayllm.runner.model_runner import ModelRunner
from rayllm.schema.step import SeqStep, StepInput

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


# What xformers refuses (its kernels per build), and per-layer options: a custom scale, a sliding
# window (local mask over the gathered context), soft-capped logits (a torch path: no xformers call).
CASES = [("", {}), ("splitk", {}), ("all", {}), ("", {"scale": 0.3}), ("", {"window": 3, "scale": 0.3}),
         ("", {"softcap": 2.0}), ("", {"window": 5, "softcap": 1.5})]


@pytest.mark.parametrize(("refuse", "options"), CASES)
def test_xformers_glue_equals_sdpa_on_chunked_prefill_and_decode(monkeypatch, refuse, options):
    fmha = install_fake_xformers(monkeypatch, refuse)
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
    if "softcap" in options:
        expected_calls = [[], [], []]
    elif "window" in options:
        expected_calls = [["gathered"]] * 3
    for seqs, calls in zip(_steps(), expected_calls, strict=True):
        t = sum(len(s.token_ids) for s in seqs)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)
        outs = {}
        for name, attn in backends.items():
            _, _, meta = runners[name].prepare(StepInput(seqs))
            fmha.calls.clear()
            outs[name] = attn(q, k, v, *caches[name], meta, **options)
        torch.testing.assert_close(outs["xformers"], outs["sdpa"], atol=1e-5, rtol=1e-5)
        # Once refused, a kind of paged call is not tried again (the refusals are not counted).
        assert fmha.calls == calls
    for sdpa_cache, xf_cache in zip(head_major, block_major, strict=True):  # new K/V written to the same slots
        torch.testing.assert_close(xf_cache.permute(2, 0, 1, 3), sdpa_cache)


@pytest.mark.parametrize("options", [{"window": 5}, {"window": 5, "softcap": 1.5}])
def test_windowed_steps_gather_from_the_first_live_block(monkeypatch, options):
    """Blocks behind every window are FREED in the tables (block_manager.py): each backend gathers from
    the first live block on and computes what it computes over the whole tables."""
    install_fake_xformers(monkeypatch)
    torch.manual_seed(0)
    hq, hk, d, bs, num_blocks = 6, 2, 8, 4, 32
    head_major = (torch.randn(hk, num_blocks, bs, d), torch.randn(hk, num_blocks, bs, d))
    caches = {"sdpa": head_major, "xformers": tuple(c.permute(1, 2, 0, 3).contiguous() for c in head_major)}
    backends = {"sdpa": SDPAAttention(), "xformers": XformersAttention()}
    full = [[9, 3, 27, 14, 6], [5, 20, 11, 2, 8]]
    # A decode row at position 17 sees 13..17 (blocks 3 on); a chunk from 12 on sees 8.. (blocks 2 on).
    dropped = [[FREED] * 3 + full[0][3:], [FREED] * 2 + full[1][2:]]
    q, k, v = torch.randn(7, hq, d), torch.randn(7, hk, d), torch.randn(7, hk, d)
    outs = {}
    for name, attn in backends.items():
        runner = ModelRunner(model=types.SimpleNamespace(attn_backend=attn), kv_caches=[caches[name]], block_size=bs,
                             vocab_size=10, device=torch.device("cpu"), is_driver=True)
        for label, tables in (("full", full), ("dropped", dropped)):
            seqs = [SeqStep("a", [0], 17, tables[0], sample=True), SeqStep("b", [0] * 6, 12, tables[1], sample=True)]
            _, _, meta = runner.prepare(StepInput(seqs))
            outs[name, label] = attn(q, k, v, *caches[name], meta, **options)
    for name in backends:
        torch.testing.assert_close(outs[name, "dropped"], outs[name, "full"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["xformers", "dropped"], outs["sdpa", "dropped"], atol=1e-5, rtol=1e-5)


def test_paged_bias_is_built_once_per_step(monkeypatch):
    fmha = install_fake_xformers(monkeypatch)
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


def test_backend_choice(monkeypatch, caplog):
    install_fake_xformers(monkeypatch)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # First without triton (auto tries it before xformers): as on a machine without it.
    monkeypatch.setitem(BACKENDS, "triton", "triton_is_not_installed_here:TritonAttention")
    assert make_attention_backend("auto", cpu).name == "sdpa"
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("xformers", cpu)
    # The probe runs one real xformers call on the GPU (none here): stood in for, as xformers itself is.
    probed = []
    monkeypatch.setattr(XformersAttention, "probe", lambda self, device, head_dim, dtype: probed.append(device))
    assert make_attention_backend("auto", cuda).name == "xformers" and probed == [cuda]
    assert make_attention_backend("sdpa", cuda).name == "sdpa"
    # xformers imports but has no kernels (a wheel built for another torch: fmha refuses every call).
    def refuse(self, device, head_dim, dtype):
        raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs:")

    monkeypatch.setattr(XformersAttention, "probe", refuse)
    with caplog.at_level(logging.WARNING, logger="rayllm.attention.selector"):
        assert make_attention_backend("auto", cuda).name == "sdpa"
    assert "No operator found" in caplog.text
    with pytest.raises(NotImplementedError):
        make_attention_backend("xformers", cuda)
    caplog.clear()
    # xformers present but unloadable (built for another torch/CUDA): auto falls back, and says so.
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    with caplog.at_level(logging.WARNING, logger="rayllm.attention.selector"):
        assert make_attention_backend("auto", cuda).name == "sdpa"
    assert "xformers attention unavailable" in caplog.text
    with pytest.raises(ImportError):
        make_attention_backend("xformers", cuda)
    assert "triton attention unavailable" in caplog.text
    # With triton: its probe (real kernels on the GPU, none here) stood in for; auto takes it first.
    triton_kernels = pytest.importorskip("rayllm.attention.triton")
    monkeypatch.undo()
    install_fake_xformers(monkeypatch)
    monkeypatch.setattr(XformersAttention, "probe", lambda self, device, head_dim, dtype: None)
    triton_prefill = pytest.importorskip("rayllm.attention.triton_prefill")  # the backend: TritonPrefillAttention
    monkeypatch.setattr(triton_prefill.TritonPrefillAttention, "probe",
                        lambda self, device, head_dim, dtype: probed.append((device, head_dim, dtype)))
    probed.clear()
    backend = make_attention_backend("auto", cuda, 256, torch.float16)  # probed at the model's shape
    assert backend.name == "triton" and probed == [(cuda, 256, torch.float16)]
    assert isinstance(backend.kernels, triton_kernels.TritonKernels)
    assert make_attention_backend("xformers", cuda).name == "xformers"
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("triton", cpu)
