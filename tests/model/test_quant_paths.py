"""The bf16 and int4 CPU kernel paths on the real model stay close to the fp32 reference.

Teacher-forced on fp32's own greedy continuations of the chat prompts: each path's next-token
choice is compared with fp32's at every position (benchmarks/quant_quality.py measures the same
at larger scale and reports KL as well).
"""

from __future__ import annotations

import pytest
import torch

from model_parallel import parallel
from model_parallel.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from model_parallel.engine import LLMEngine
from model_parallel.sampling_params import SamplingParams

NEW_TOKENS = 32


def make_engine(gguf_path: str, dtype: str, weights: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=gguf_path, dtype=dtype, weights=weights),
        cache=CacheConfig(kv_cache_bytes=128 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        parallel=ParallelConfig(device="cpu"),
    ))


@pytest.fixture(scope="module")
def reference(gguf_path, chat_prompts):
    """fp32: greedy continuations and their teacher-forced next-token argmax at each position."""
    engine = make_engine(gguf_path, "float32")
    try:
        outs = engine.generate(chat_prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        tops = [engine.executor.score(p + o)[len(p) - 1 : -1].argmax(-1) for p, o in zip(chat_prompts, outs, strict=True)]
    finally:
        engine.shutdown()
    return outs, tops


def agreement(engine: LLMEngine, prompts, reference) -> float:
    outs, tops = reference
    got = [engine.executor.score(p + o)[len(p) - 1 : -1].argmax(-1) for p, o in zip(prompts, outs, strict=True)]
    return float((torch.cat(got) == torch.cat(tops)).float().mean())


@pytest.mark.parametrize("path", ["bf16", "int4", "quantized"])
def test_cpu_kernel_paths_agree_with_fp32(gguf_path, chat_prompts, reference, path, monkeypatch):
    """quantized: `model.weights: quantized`, the GGUF's blocks kept as they are (no dense linear weights)."""
    engine = make_engine(gguf_path, "bfloat16", "quantized" if path == "quantized" else "auto")
    try:
        # Force one kernel for whole prompts: int4 (the GGUF's Q4 weights, what steps of <= 8 tokens
        # run), or bf16 (what larger steps run).
        monkeypatch.setattr(parallel, "SMALL_BATCH_TOKENS", 1 << 30 if path == "int4" else 0)
        agree = agreement(engine, chat_prompts, reference)
    finally:
        engine.shutdown()
    # Measured (benchmarks/quant_quality.py, 1,024 positions): bf16 0.97, int4 0.97; the rejected
    # per-token W8A8 candidate 0.88. A broken kernel gives ~0.
    assert agree >= 0.93, f"{path}: top-1 agreement with fp32 {agree:.3f}"
