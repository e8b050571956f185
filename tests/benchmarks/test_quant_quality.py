"""benchmarks/quant_quality.py's teacher-forced measure on a fixed subset of its prompts: the shipped CPU path
(cluster.yaml's parallel.cpu, real SmolLM2 weights) stays within issue 35's targets against fp32, so a
quality regression of the kernels fails CI (speed is measured in benchmarks/ only)."""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from rayllm.engine.engine import LLMEngine
from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quant_quality as qq  # noqa: E402
from quality_prompts import quality_prompts  # noqa: E402

pytestmark = pytest.mark.slow  # the real model: `make test-fast` skips it

PROMPTS = 45  # the benchmark's first 45 of 576: five of each of its nine kinds, 1,440 positions
NEW_TOKENS = 32
# Issue 35's targets (bf16 activations measure about 0.0023 / 0.970 on the full set, docs/cpu.md).
MAX_MEAN_KL, MIN_TOP1 = 0.0025, 0.970


def shipped_cpu_config() -> CpuConfig:
    """cluster.yaml's parallel.cpu, as `make serve` runs it."""
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    (engine,) = [app["args"]["engine"] for app in cluster["applications"] if "engine" in app.get("args", {})]
    return CpuConfig(**engine["parallel"]["cpu"])


def test_the_shipped_cpu_path_is_within_the_quality_targets(gguf_path, hf_tokenizer):
    cpu = shipped_cpu_config()
    if cpu.small_batch_quant == "auto" and not cpu_qgemm.available():
        pytest.skip("no AVX-512 VNNI on this CPU (or no C compiler)")
    batch = [hf_tokenizer(hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                           add_generation_prompt=True), add_special_tokens=False).input_ids
             for _, text in quality_prompts(PROMPTS)]
    ref_engine = qq.make_engine(gguf_path, "float32", "none", len(batch))
    try:
        outs = ref_engine.generate(batch, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        tops = qq.score(ref_engine, batch, outs, lambda i, lp: lp.topk(qq.TOP_K, -1))
    finally:
        ref_engine.shutdown()
    vals, idx = torch.cat([t.values for t in tops]), torch.cat([t.indices for t in tops])
    at = [0, *torch.tensor([len(o) for o in outs]).cumsum(0).tolist()]
    # Both cores: the kernels' rows do not depend on the thread count (tests/platforms/cpu/test_cpu_qgemm.py).
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=gguf_path, dtype="bfloat16"),
        cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        parallel=ParallelConfig(device="cpu", cpu=dataclasses.replace(cpu, threads_per_rank=0)),
    ))
    qq.use_kernel("small-batch")  # every position on the small-batch kernels, as decode steps run them
    try:
        per_prompt = qq.score(engine, batch, outs, partial(qq.compare_prompt, vals, idx,
                                                           torch.cat([torch.tensor(o) for o in outs]), at))
    finally:
        qq.use_kernel("default")
        engine.shutdown()
    got = qq.summary({k: torch.cat([p[k] for p in per_prompt]) for k in per_prompt[0]})
    assert got["kl_mean"] <= MAX_MEAN_KL and got["top1_agree"] >= MIN_TOP1, f"shipped CPU path vs fp32: {got}"
