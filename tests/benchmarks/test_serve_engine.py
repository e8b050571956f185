"""benchmarks/serve_engine.py: the engine it measures is the one cluster.yaml configures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_engine import engine_config, measure, variant_prompts  # noqa: E402


def test_engine_settings_come_from_the_served_config():
    engine = engine_config(str(ROOT / "cluster.yaml"))
    shipped = yaml.safe_load((ROOT / "cluster.yaml").read_text())["applications"][0]["args"]["engine"]
    assert engine.parallel.cpu.threads_per_rank == shipped["parallel"]["cpu"]["threads_per_rank"]
    assert engine.parallel.cpu.threads_single_sequence == shipped["parallel"]["cpu"]["threads_single_sequence"]
    assert engine.parallel.cpu.wide_step_tokens == shipped["parallel"]["cpu"]["wide_step_tokens"]
    assert engine.parallel.cpu.half_step_tokens == shipped["parallel"]["cpu"]["half_step_tokens"]
    assert engine.scheduler.max_num_batched_tokens == shipped["scheduler"]["max_num_batched_tokens"]
    assert engine.cache.enable_prefix_caching == shipped["cache"]["enable_prefix_caching"]
    assert engine.model.model.endswith(".gguf") and Path(engine.model.model).is_file()  # null: the default model
    assert engine.parallel.device in ("cpu", "cuda")  # auto resolved, as the builder does


@pytest.mark.slow  # two engines: `make test-fast` skips it
def test_the_gpu_runs_reference_engine_and_its_step_times(tmp_path, hf_tokenizer):
    """serve_engine.py as tests/gpu/serve_device.sh runs it, here on CPU with a tiny Llama of RANDOM weights and
    the default model's tokenizer: the `mixed` workload's prompts are 128-1,024 tokens (issue 32's range),
    `lora_off` is the served config without adapter slots, and each line has the prefill and median step and the
    closed-loop reference (serve_bench.py's arrivals, offline)."""
    import torch

    from tests.gpu.serve_device_models import TINY_SHAPE, save_llama

    tok = hf_tokenizer
    lengths = [len(p) for p in variant_prompts(tok, "mixed", 64)]
    assert 128 <= min(lengths) and max(lengths) <= 1024 and max(lengths) - min(lengths) > 512
    save_llama(tmp_path / "model", TINY_SHAPE, tok, torch.float32, "cpu")
    engine = {"model": {"model": str(tmp_path / "model"), "dtype": "float32"}, "parallel": {"device": "cpu"},
              "cache": {"kv_cache_bytes": 64 << 20}, "lora": {"max_loras": 2}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"args": {"engine": engine}}]}))
    [line] = measure(str(path), [3], 4, 1, "mixed", ["lora_off"], closed=True)  # the served config has 2 slots
    assert (line["setting"], line["max_loras"], line["variant"]) == ("lora_off", 0, "mixed")
    assert 128 <= line["prompt_tokens_mean"] <= 1024 and line["engine_tok_s"] > 0
    assert line["first_step_ms"] > line["step_ms_p50"] > 0  # three prompts' prefill against a 3-row decode step
    # serve_bench.py's closed loop at 3 streams: 8 requests (its count for `mixed`), every one run to its end
    assert (line["closed_requests"], line["closed_tokens"]) == (8, 8 * 4) and line["closed_tok_s"] > 0
