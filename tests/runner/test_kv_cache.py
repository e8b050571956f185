"""KV cache sizing: a budget that holds no blocks stops the engine at start with an error naming the knob."""

from __future__ import annotations

import pytest

from rayllm.engine.engine import LLMEngine
from rayllm.schema.config import CacheConfig, EngineConfig, ParallelConfig


def test_engine_with_no_room_for_kv_fails_at_start_naming_the_budget():
    config = EngineConfig(cache=CacheConfig(kv_cache_bytes=4096), parallel=ParallelConfig(device="cpu"))
    with pytest.raises(RuntimeError, match="KV cache budget holds 0 blocks.*kv_cache_bytes 4096"):
        LLMEngine(config)


def test_profile_step_is_the_largest_step_on_disjoint_blocks():
    from rayllm.runner.kv_cache import profile_step

    step, num_blocks = profile_step(max_tokens=1000, max_seqs=64, block_size=16)
    assert sum(len(s.token_ids) for s in step.seqs) == 1000 and len(step.seqs) == 64
    assert all(s.sample and s.start_pos == 0 for s in step.seqs)  # logits for every sequence
    blocks = [b for s in step.seqs for b in s.block_table]
    assert sorted(blocks) == list(range(num_blocks))  # disjoint, and exactly what the profile allocates
    assert all(len(s.block_table) * 16 >= len(s.token_ids) for s in step.seqs)
    step, _ = profile_step(max_tokens=8, max_seqs=64, block_size=16)
    assert len(step.seqs) == 8  # never more sequences than tokens
