"""The engine with attention_backend triton against the torch reference path, on a tiny Llama with RANDOM
weights (tests/attention/tiny_models.py: the default model's head dim and KV grouping, two layers).

Triton compiles for GPUs only: here its interpreter (TRITON_INTERPRET=1, set before the kernels are
imported) runs the same kernel code on CPU, and the backend is chosen by patching the worker's factory,
which refuses Triton without CUDA. fp16: every kernel runs (attention, cache write, norm, rotary, SiLU),
where bf16 cannot (the interpreter's tl.dot reads bf16 as raw bits, tests/attention/test_triton_kernels.py);
the GPU lane runs all of it natively in bf16 and fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import rayllm.executor.worker as worker_module  # noqa: E402
from rayllm.attention.triton import TritonAttention  # noqa: E402
from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from rayllm.schema.sampling_params import SamplingParams  # noqa: E402
from tests.attention.tiny_models import ids, tiny  # noqa: E402

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def make_engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype="float16"),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        # 16 tokens a step: the longer prompt is prefilled in chunks after its own cached part.
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        parallel=ParallelConfig(device="cpu", attention_backend="sdpa")), eos_token_ids=[])


def test_greedy_tokens_equal_the_torch_path(tmp_path, monkeypatch):
    path = tiny(tmp_path / "llama", "llama")
    prompts = [ids(24, 1), ids(6, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = make_engine(path)
    try:
        want = reference.generate(prompts, params)
    finally:
        reference.shutdown()
    monkeypatch.setattr(worker_module, "make_attention_backend", lambda choice, device, head_dim, dtype: TritonAttention())
    engine = make_engine(path)
    try:
        worker = engine.executor.worker
        assert worker.attn_backend.name == "triton" and worker.runner.attn_builder.kernels
        layer = worker.model.layers[0]
        assert layer.input_layernorm.kernels is worker.attn_backend.kernels  # the fused kernels are in use
        assert engine.generate(prompts, params) == want
    finally:
        engine.shutdown()
