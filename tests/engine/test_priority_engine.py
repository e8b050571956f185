"""Priority scheduling on the real default model: a high-priority request arriving behind a saturating
low-priority batch preempts it, finishes first, and every output still equals transformers' greedy one."""

from __future__ import annotations

import pytest

from rayllm.engine.engine import LLMEngine
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model

MAX_TOKENS = 12


def test_high_priority_request_overtakes_a_saturating_batch(gguf_path, eos, hf_greedy, chat_prompts):
    engine = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=gguf_path, dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=64 << 20),
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256, policy="priority"),
            parallel=ParallelConfig(device="cpu"),
        ),
        eos_token_ids=eos,
    )
    batch = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, priority=1)
    urgent = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, priority=-1)
    tokens: dict[str, list[int]] = {}
    done: list[tuple[str, int]] = []
    try:
        for i, ids in enumerate(chat_prompts[:4]):
            engine.add_request(f"batch-{i}", ids, batch)
        for _ in range(3):  # both slots busy with decoding batch requests
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert len(engine.scheduler.running) == 2
        engine.add_request("urgent", chat_prompts[4], urgent)
        steps = 0
        while engine.has_work():
            steps += 1
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    done.append((out.request_id, steps))
        assert engine.scheduler.num_preemptions >= 1
        # Admitted at once (a prefill step, then one step per token): it never waited for a slot. Only the
        # batch request that kept the other slot may finish before it.
        urgent_steps = dict(done)["urgent"]
        assert urgent_steps <= MAX_TOKENS, done
        assert [rid for rid, _ in done].index("urgent") <= 1, done
    finally:
        engine.shutdown()
    for rid, ids in [(f"batch-{i}", p) for i, p in enumerate(chat_prompts[:4])] + [("urgent", chat_prompts[4])]:
        # reference: transformers' greedy generate, the prompt alone
        assert tokens[rid] == hf_greedy(ids, MAX_TOKENS), rid
