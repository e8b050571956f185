"""Engine behaviour on the real default model: continuous batching, prefix cache, preemption, aborts, seeds."""

from __future__ import annotations

import os

import pytest
import ray
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.platforms.cpu.kernels import onednn_cache_env
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def make_engine(gguf_path: str, eos: list[int], tp: int = 1, backend: str = "auto", **cache) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=gguf_path, dtype="float32"),
            cache=CacheConfig(**({"kv_cache_bytes": 256 << 20} | cache)),
            # A small token budget so long prompts are prefilled in several chunks.
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
            parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu", attention_backend=backend),
        ),
        eos_token_ids=eos,
    )


@pytest.fixture(scope="module")
def engine(gguf_path, eos) -> LLMEngine:
    eng = make_engine(gguf_path, eos)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference_outputs(hf_greedy, chat_prompts) -> list[list[int]]:
    """transformers' greedy generate, each prompt alone, stopping at the same EOS ids."""
    return [hf_greedy(ids, GREEDY.max_tokens) for ids in chat_prompts]


def test_batched_greedy_equals_transformers_alone(engine, chat_prompts, reference_outputs):
    got = engine.generate(chat_prompts, GREEDY)
    assert got == reference_outputs


def test_bad_words_match_transformers_bad_words_ids(engine, hf_model, eos, chat_prompts, reference_outputs):
    """vLLM's bad_words as token sequences: greedy output equals transformers' generate with the same
    bad_words_ids (a one-token word, and a two-token one whose first token the free answer generates), while
    an unconstrained neighbour in the batch is unchanged."""
    prompt, free = chat_prompts[0], reference_outputs[0]
    one, (a, b) = free[2], free[5:7]
    assert prompt[-1] != a  # transformers also matches across the prompt; a word here starts in the output
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos[0], bad_words_ids=[[one], [a, b]])
    want = gen[0, len(prompt):].tolist()
    assert want != free and one not in want
    banned = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, bad_words_token_ids=((one,), (a, b)))
    got, neighbour = engine.generate([prompt, chat_prompts[1]], [banned, GREEDY])
    assert got == want and neighbour == reference_outputs[1]


def test_prefix_cache_hit_gives_same_output_and_reports_cached_tokens(engine, hf_tokenizer):
    text = "Here is a long shared context about the history of Paris. " * 6 + "Summarise it."
    ids = hf_tokenizer(text).input_ids
    assert len(ids) > 3 * engine.config.cache.block_size
    cold = _run_one(engine, "cold", ids)
    warm = _run_one(engine, "warm", ids)
    assert warm["tokens"] == cold["tokens"]
    assert cold["cached"] == 0
    bs = engine.config.cache.block_size
    assert warm["cached"] == (len(ids) - 1) // bs * bs


def test_burst_shares_its_common_prefix_within_one_step(engine, chat_prompts, reference_outputs):
    """Requests admitted in the same step reuse the blocks an earlier one of them is computing."""
    _check_burst(engine, chat_prompts, reference_outputs)


def test_burst_sharing_on_the_torch_attention_path(gguf_path, eos, chat_prompts, reference_outputs):
    """The same through torch SDPA (no C kernels): a sharing sequence reads its prefix from the cache."""
    eng = make_engine(gguf_path, eos, backend="sdpa")
    try:
        _check_burst(eng, chat_prompts, reference_outputs)
    finally:
        eng.shutdown()


def _check_burst(engine: LLMEngine, chat_prompts, reference_outputs) -> None:
    engine.block_manager.reset_prefix_cache()
    bs = engine.config.cache.block_size
    common = next(i for i in range(min(map(len, chat_prompts))) if len({p[i] for p in chat_prompts}) > 1)
    assert common >= bs  # the chat template's system prompt fills at least one block
    ids = [f"burst-{i}" for i in range(len(chat_prompts))]
    for rid, prompt in zip(ids, chat_prompts, strict=True):
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached.setdefault(out.request_id, out.num_cached_tokens)
    assert [tokens[rid] for rid in ids] == reference_outputs
    # The first request computed the shared blocks; every other one (admitted in the same step or the
    # next chunk of prompts under the small token budget) reused them.
    assert cached[ids[0]] == 0
    assert all(cached[rid] >= common // bs * bs for rid in ids[1:])


def _run_one(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams = GREEDY) -> dict:
    engine.add_request(rid, ids, params)
    tokens: list[int] = []
    cached = None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return {"tokens": tokens, "cached": cached}


def test_tiny_kv_cache_preempts_and_still_matches(gguf_path, eos, chat_prompts, reference_outputs):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~60 tokens at once: preemption must happen.
    eng = make_engine(gguf_path, eos, num_blocks_override=12)
    try:
        got = eng.generate(chat_prompts, GREEDY)
        assert eng.scheduler.num_preemptions > 0
        assert got == reference_outputs
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_abort_frees_every_block(engine, chat_prompts):
    for i, ids in enumerate(chat_prompts):
        engine.add_request(f"abort-{i}", ids, SamplingParams(temperature=0.0, max_tokens=200))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(len(chat_prompts)):
        out = engine.abort(f"abort-{i}")
        assert out is not None and out.finished and out.finish_reason == "abort"
    assert not engine.has_work()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_same_alone_and_in_busy_batch(engine, chat_prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _run_one(engine, "seed-alone", chat_prompts[0], seeded)["tokens"]
    noisy = SamplingParams(temperature=1.0, max_tokens=20)
    for i, ids in enumerate(chat_prompts[1:]):
        engine.add_request(f"noise-{i}", ids, noisy)
    busy = _run_one(engine, "seed-busy", chat_prompts[0], seeded)["tokens"]
    assert busy == alone
    other = _run_one(engine, "seed-other", chat_prompts[0], SamplingParams(**{**seeded.__dict__, "seed": 99}))
    assert other["tokens"] != alone  # the seed really drives the draw


def test_tensor_parallel_2_greedy_matches(gguf_path, eos, chat_prompts, reference_outputs, ray_local):
    eng = make_engine(gguf_path, eos, tp=2)
    try:
        assert eng.generate(chat_prompts[:4], GREEDY) == reference_outputs[:4]
        # Each rank's process started with oneDNN's shape caches bounded (as the engine child's are).
        envs = ray.get([w.__ray_call__.remote(lambda self: {k: os.environ.get(k) for k in onednn_cache_env({})})
                              for w in eng.executor.workers])
        assert envs == [{k: os.environ.get(k, v) for k, v in onednn_cache_env({}).items()}] * 2
    finally:
        eng.shutdown()


def test_a_lone_sequence_gets_its_own_thread_count(gguf_path, eos, chat_prompts):
    """cpu.threads_single_sequence applies to steps of one sequence only; batches use cpu.threads_per_rank."""
    before = torch.get_num_threads()
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=gguf_path, dtype="bfloat16"),
            cache=CacheConfig(kv_cache_bytes=64 << 20),
            parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1, threads_single_sequence=2)),
        ),
        eos_token_ids=eos,
    )
    seen: list[tuple[int, int]] = []  # (sequences in the step, torch threads while it ran)
    runner = eng.executor.worker.runner
    run = runner.execute

    def spy(step):
        seen.append((len(step.seqs), torch.get_num_threads()))
        return run(step)

    runner.execute = spy
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        eng.generate(chat_prompts[:2], params)  # both in every step, finishing together
        eng.generate(chat_prompts[:1], params)
    finally:
        eng.shutdown()
        torch.set_num_threads(before)
    assert {threads for n, threads in seen if n == 1} == {2}
    assert {threads for n, threads in seen if n > 1} == {1}


def test_a_wide_step_gets_the_single_sequence_thread_count(gguf_path, eos, chat_prompts):
    """cpu.wide_step_tokens: a step of that many tokens (prefill chunks) runs on cpu.threads_single_sequence
    threads; the same sequences' one-token decode steps stay on cpu.threads_per_rank."""
    before = torch.get_num_threads()
    wide = len(chat_prompts[0]) + len(chat_prompts[1])  # both prompts in the first step
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=gguf_path, dtype="bfloat16"),
            cache=CacheConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False),
            parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1, threads_single_sequence=2,
                                                                   wide_step_tokens=wide)),
        ),
        eos_token_ids=eos,
    )
    seen: list[tuple[int, int]] = []  # (tokens in the step, torch threads while it ran)
    runner = eng.executor.worker.runner
    run = runner.execute

    def spy(step):
        seen.append((sum(len(s.token_ids) for s in step.seqs), torch.get_num_threads()))
        return run(step)

    runner.execute = spy
    try:
        eng.generate(chat_prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        eng.shutdown()
        torch.set_num_threads(before)
    assert seen[0] == (wide, 2)
    assert {threads for tokens, threads in seen[1:]} == {1} and all(tokens == 2 for tokens, _ in seen[1:])


def test_steps_in_two_halves_match_transformers(gguf_path, eos, hf_model, chat_prompts, reference_outputs):
    """cpu.half_step_tokens: steps of that many tokens run their sequences in two halves on two threads
    (split_step.py), prefill chunks and decode batches; every output still equals transformers' alone,
    including a burst whose later requests attend to prefix blocks the first one fills in that step.
    A step that runs whole computes its LM head in two halves of the vocabulary, one on each thread."""
    before = torch.get_num_threads()
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=gguf_path, dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=256 << 20),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
            parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1, half_step_tokens=4)),
        ),
        eos_token_ids=eos,
    )
    try:
        halves = eng.executor.worker.runner.halves
        assert halves is not None
        assert eng.generate(chat_prompts, GREEDY) == reference_outputs
        assert halves.steps > 0
        steps = halves.steps
        _check_burst(eng, chat_prompts, reference_outputs)
        assert halves.steps > steps
        # One prompt alone runs whole: its logits at every position come from the two vocabulary halves.
        calls = halves.lm_head_calls
        got = eng.executor.worker.score(chat_prompts[0])
        assert halves.lm_head_calls == calls + 1
        with torch.no_grad():
            expected = hf_model(torch.tensor([chat_prompts[0]])).logits[0]
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    finally:
        eng.shutdown()
        torch.set_num_threads(before)


def test_timings_mark_the_queue_prefill_and_decode_steps(engine, chat_prompts):
    """EngineTimings (the engine's spans when tracing is on) fall in the steps where each phase ended: the
    first scheduling in an earlier step than the first token when the prompt is prefilled in chunks."""
    import time

    ids = [t for p in chat_prompts for t in p][::-1][:150]  # > 64 tokens, none cached: three prefill chunks
    before = time.time_ns()
    engine.add_request("timed", ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    after = time.time_ns()
    steps, last = [], None
    while engine.has_work():
        t0 = time.time_ns()
        outs = [o for o in engine.step() if o.request_id == "timed"]
        steps.append((t0, time.time_ns(), outs))
        assert all((o.timings is not None) == o.finished for o in outs)  # on the last output only
        last = outs[-1] if outs and outs[-1].finished else last
    t = last.timings
    assert before <= t.arrival_ns <= after
    first_token_step = next(i for i, (_, _, outs) in enumerate(steps) if any(o.new_token_ids for o in outs))
    assert first_token_step == 2  # 150 prompt tokens, 64 a step
    assert steps[0][0] <= t.scheduled_ns <= steps[0][1]
    assert steps[first_token_step][0] <= t.first_token_ns <= steps[first_token_step][1]
    assert steps[-1][0] <= t.finished_ns <= steps[-1][1] and len(steps) == first_token_step + 3


def test_an_abort_acknowledges_with_the_timings_of_the_phases_reached(engine, chat_prompts):
    """The abort's output (what the replica traces after a stop string or a client gone) carries the
    sequence's timestamps up to the abort, 0 for the phases it never reached: one aborted while queued, one
    in its prefill (its prompt is chunked), one while decoding."""
    import time

    # A salt of its own: no prefix of the module's other requests is cached for these.
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, cache_salt="abort-timings")
    long_prompt = [t for p in chat_prompts for t in p][::-1][:150]  # > 64 tokens: three prefill chunks
    engine.add_request("queued", chat_prompts[0], params)
    queued = engine.abort("queued")
    engine.add_request("decode", chat_prompts[1], params)  # first: its prompt fits the first step's budget
    engine.add_request("prefill", long_prompt, params)
    while True:
        outs = {o.request_id: o for o in engine.step()}
        if "decode" in outs:
            break
    engine.step()  # a decode step for it
    before = time.time_ns()
    prefill, decode = engine.abort("prefill"), engine.abort("decode")
    after = time.time_ns()
    assert not engine.has_work()

    t = queued.timings
    assert queued.finish_reason == "abort" and t.arrival_ns <= t.finished_ns and t.scheduled_ns == t.first_token_ns == 0
    t = prefill.timings
    assert prefill.finish_reason == "abort" and t.first_token_ns == 0
    assert 0 < t.arrival_ns <= t.scheduled_ns < before <= t.finished_ns <= after
    t = decode.timings
    assert decode.finish_reason == "abort" and 0 < t.arrival_ns <= t.scheduled_ns <= t.first_token_ns < before
    assert before <= t.finished_ns <= after
