"""The engine with the triton backend (TritonPrefillAttention: prefill chunks through
triton_prefill.py's kernel, decode rows through triton_kernels') against references.

Triton compiles for GPUs only: here its interpreter (TRITON_INTERPRET=1, set before the kernels are
imported) runs the same kernel code on CPU, and the backend is chosen by patching the worker's factory,
which refuses Triton without CUDA.
- the real default model in fp16 (every Triton kernel runs; the interpreter cannot do bf16 dots), long
  prompts prefilled in chunks after their own cached part and after a prefix shared through the prefix
  cache: greedy tokens equal the torch SDPA path's;
- tiny models with RANDOM weights built by transformers in the test: Gemma 2 (sliding-window layers
  between global ones, soft-capped logits, a query scale not the head dim's) and Mistral (every layer
  windowed, so blocks behind the window are freed), in fp32: logits against transformers', and greedy
  tokens with chunked prefill against the SDPA path's. Before this backend these models took the torch
  path; the tests check that they now run the kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import rayllm.executor.worker as worker_module  # noqa: E402
from rayllm.attention.triton_prefill import TritonPrefillAttention  # noqa: E402
from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from rayllm.schema.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

VOCAB = 256


def engine(path: str, dtype: str, block_size: int, budget: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype=dtype),
        cache=CacheConfig(kv_cache_bytes=64 << 20, block_size=block_size),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
        parallel=ParallelConfig(device="cpu", attention_backend="sdpa")), eos_token_ids=[])


def both_backends(monkeypatch, path: str, prompts: list[list[int]], dtype: str, block_size: int, budget: int,
                  max_tokens: int) -> tuple[list[list[int]], list[list[int]], LLMEngine | None]:
    """Greedy tokens from the SDPA path, then from the triton backend (whose engine is returned, shut down)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ref = engine(path, dtype, block_size, budget)
    try:
        want = ref.generate(prompts, params)
    finally:
        ref.shutdown()
    monkeypatch.setattr(worker_module, "make_attention_backend", lambda choice, device: TritonPrefillAttention())
    ours = engine(path, dtype, block_size, budget)
    try:
        worker = ours.executor.worker
        assert worker.attn_backend.name == "triton" and worker.runner.paged_kernels  # the kernels, not torch
        got = ours.generate(prompts, params)
    finally:
        ours.shutdown()
    return want, got, ours


def test_real_model_chunked_and_prefix_cached_prefill(gguf_path, chat_prompts, monkeypatch):
    shared = chat_prompts[0][:20]
    prompts = [chat_prompts[0][:37], shared + chat_prompts[1][:9], chat_prompts[1][:5]]
    want, got, _ = both_backends(monkeypatch, gguf_path, prompts, "float16", 16, 24, 3)
    assert got == want


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


def tiny(path, family: str) -> str:
    """Random weights (transformers' init, random norm weights so Gemma's (1 + w) matters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8)
    if family == "gemma2":
        cfg = AutoConfig.for_model("gemma2", **common, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=5.0, final_logit_softcapping=5.0)
    else:
        cfg = AutoConfig.for_model("mistral", **common, num_hidden_layers=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_windowed_and_soft_capped_models(tmp_path, monkeypatch, family):
    from transformers import AutoModelForCausalLM

    path = tiny(tmp_path / family, family)
    shared = ids(14, 1)
    prompts = [ids(29, 2), shared + ids(6, 3), shared + ids(11, 4)]
    want, got, _ = both_backends(monkeypatch, path, prompts, "float32", 4, 16, 10)
    assert got == want
    # and the first prompt's greedy continuation is transformers' own
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompts[0]]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    assert got[0] == out[0, len(prompts[0]) :].tolist()
