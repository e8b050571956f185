"""KV cache sizing: a budget that holds no blocks stops the engine at start with an error naming the knob."""

from __future__ import annotations

import pytest

from model_parallel.config import CacheConfig, EngineConfig, ParallelConfig
from model_parallel.engine import LLMEngine


def test_engine_with_no_room_for_kv_fails_at_start_naming_the_budget():
    config = EngineConfig(cache=CacheConfig(kv_cache_bytes=4096), parallel=ParallelConfig(device="cpu"))
    with pytest.raises(RuntimeError, match="KV cache budget holds 0 blocks.*kv_cache_bytes 4096"):
        LLMEngine(config)
