"""benchmarks/serve_engine.py: the engine it measures is the one cluster.yaml configures."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_engine import engine_config  # noqa: E402


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
