"""The engine with the triton backend (TritonPrefillAttention: prefill chunks through
triton_prefill.py's kernel, decode rows through triton_kernels') against references.

Triton compiles for GPUs only: here its interpreter (TRITON_INTERPRET=1, set before the kernels are
imported) runs the same kernel code on CPU, and the backend is chosen by patching the worker's factory,
which refuses Triton without CUDA.
- a tiny Llama with RANDOM weights (tests/attention/tiny_models.py: the default model's head dim and KV
  grouping) in fp16 (every Triton kernel runs; the interpreter cannot do bf16 dots), long prompts
  prefilled in chunks after their own cached part and after a prefix shared through the prefix cache:
  greedy tokens equal the torch SDPA path's;
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
from tests.attention.tiny_models import ids, tiny  # noqa: E402

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


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
    monkeypatch.setattr(worker_module, "make_attention_backend", lambda choice, device, head_dim, dtype: TritonPrefillAttention())
    ours = engine(path, dtype, block_size, budget)
    try:
        worker = ours.executor.worker
        assert worker.attn_backend.name == "triton" and worker.runner.attn_builder.kernels  # the kernels, not torch
        got = ours.generate(prompts, params)
    finally:
        ours.shutdown()
    return want, got, ours


def test_chunked_and_prefix_cached_prefill_in_fp16(tmp_path, monkeypatch):
    path = tiny(tmp_path / "llama", "llama")
    shared = ids(20, 5)
    prompts = [shared + ids(17, 6), shared + ids(9, 7), ids(5, 8)]
    want, got, _ = both_backends(monkeypatch, path, prompts, "float16", 16, 24, 4)
    assert got == want


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
