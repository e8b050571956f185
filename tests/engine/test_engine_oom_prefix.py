"""A device out-of-memory in a step forgets, from the prefix cache, only the blocks that step was to fill
(hashed when it was scheduled, holding no KV now): the blocks of earlier steps keep serving prefix hits.
On the real default model; the fault is the test-only debug.fail_step_with_oom_after (docs/gpu.md)."""

from __future__ import annotations

import dataclasses

import pytest

from rayllm.engine.engine import LLMEngine
from rayllm.schema.config import (
    CacheConfig,
    DebugConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], int, str | None]:
    """(tokens, cached prompt tokens, error) of one request run to its end."""
    engine.add_request(rid, prompt, GREEDY)
    tokens, cached, error = [], 0, None
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            cached, error = out.num_cached_tokens, out.error or error
    return tokens, cached, error


def test_out_of_memory_forgets_only_the_steps_blocks(gguf_path, eos, chat_prompts):
    first, second = chat_prompts[0] * 3, chat_prompts[1] * 3  # several 16-token blocks each
    config = EngineConfig(model=ModelConfig(model=gguf_path, dtype="float32", max_model_len=1024),
                          cache=CacheConfig(kv_cache_bytes=64 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
                          parallel=ParallelConfig(device="cpu"))
    solo = LLMEngine(config, eos_token_ids=eos)
    try:
        want = {name: run(solo, name, p)[0] for name, p in (("first", first), ("second", second))}
    finally:
        solo.shutdown()
    # `first` runs whole (its prefill and its 6 decode steps: steps 0-5); the next step, `second`'s
    # prefill, raises the out-of-memory.
    oom = LLMEngine(dataclasses.replace(config, debug=DebugConfig(fail_step_with_oom_after=6)), eos_token_ids=eos)
    try:
        assert run(oom, "first", first)[0] == want["first"] and oom.executor.worker.steps == 6
        tokens, _, error = run(oom, "second", second)
        assert error is not None and error.startswith("OutOfMemoryError:") and not tokens
        bs = oom.block_manager.block_size
        # The earlier request's blocks survived: its prompt is served from the cache (all but its last
        # partial block), and still exactly.
        tokens, cached, error = run(oom, "first again", first)
        assert error is None and tokens == want["first"]
        assert cached == (len(first) - 1) // bs * bs > 0
        # The failed step's blocks were forgotten: of `second` only the blocks it shares with `first` (the
        # chat template's head) are reused, and its output is exact.
        shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b) // bs * bs
        tokens, cached, error = run(oom, "second again", second)
        assert error is None and cached == shared < len(second) - bs and tokens == want["second"]
    finally:
        oom.shutdown()
