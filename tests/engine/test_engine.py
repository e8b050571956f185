"""Engine behaviour: continuous batching, prefix cache, preemption, aborts, seeds, bad words, thread counts,
steps in two halves, tensor parallelism, timings. One test runs the real default model (the SmolLM2-135M GGUF)
against transformers' generate: the end-to-end check of the real file. Every other test runs `tiny_llama`
(RANDOM weights, the default model's vocabulary: tests/conftest.py) against transformers on the same
checkpoint (`tiny_hf_model`): what they check does not depend on what the model says."""

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
TINY_CACHE = 16 << 20  # KV bytes for the tiny model's engines: 32k tokens at its 512 bytes a token


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


def make_tiny_engine(tiny_llama: str, eos: list[int], tp: int = 1, backend: str = "auto", **cache) -> LLMEngine:
    """make_engine on the tiny random model, with a KV cache its size."""
    return make_engine(tiny_llama, eos, tp, backend, **({"kv_cache_bytes": TINY_CACHE} | cache))


def hf_generate(model, ids: list[int], eos: list[int], **kwargs) -> list[int]:
    """transformers' greedy generate of one prompt alone, GREEDY's length, stopping at the chat EOS ids."""
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0], **kwargs)
    return gen[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama, eos) -> LLMEngine:
    """The tiny random model's engine (fp32), shared by the module's behaviour tests."""
    eng = make_tiny_engine(tiny_llama, eos)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tiny_reference(tiny_hf_model, eos, chat_prompts) -> list[list[int]]:
    """transformers' greedy generate on the tiny model, each prompt alone, stopping at the same EOS ids."""
    return [hf_generate(tiny_hf_model, ids, eos) for ids in chat_prompts]


def test_batched_greedy_equals_transformers_alone(gguf_path, eos, hf_greedy, chat_prompts):
    """The real GGUF (the engine's own loader and kernels on real weights), batched, against transformers'
    own GGUF loading and Llama generating each prompt alone, stopping at the same EOS ids. The module's one
    engine on the real model: built here, so that it is gone before the tiny model's tests."""
    reference = [hf_greedy(ids, GREEDY.max_tokens) for ids in chat_prompts]
    engine = make_engine(gguf_path, eos)
    try:
        assert engine.generate(chat_prompts, GREEDY) == reference
    finally:
        engine.shutdown()


def test_bad_words_match_transformers_bad_words_ids(tiny_engine, tiny_hf_model, eos, chat_prompts, tiny_reference):
    """vLLM's bad_words as token sequences: greedy output equals transformers' generate with the same
    bad_words_ids (a one-token word, and a two-token one whose first token the free answer generates), while
    an unconstrained neighbour in the batch is unchanged. On the tiny model."""
    prompt, free = chat_prompts[0], tiny_reference[0]
    one, (a, b) = free[2], free[5:7]
    assert prompt[-1] != a  # transformers also matches across the prompt; a word here starts in the output
    assert a != one  # the two-token word is not already banned by the one-token word
    want = hf_generate(tiny_hf_model, prompt, eos, bad_words_ids=[[one], [a, b]])
    assert want != free and one not in want
    banned = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, bad_words_token_ids=((one,), (a, b)))
    got, neighbour = tiny_engine.generate([prompt, chat_prompts[1]], [banned, GREEDY])
    assert got == want and neighbour == tiny_reference[1]


def test_prefix_cache_hit_gives_same_output_and_reports_cached_tokens(tiny_engine, hf_tokenizer):
    engine = tiny_engine
    text = "Here is a long shared context about the history of Paris. " * 6 + "Summarise it."
    ids = hf_tokenizer(text).input_ids
    assert len(ids) > 3 * engine.config.cache.block_size
    cold = _run_one(engine, "cold", ids)
    warm = _run_one(engine, "warm", ids)
    assert warm["tokens"] == cold["tokens"]
    assert cold["cached"] == 0
    bs = engine.config.cache.block_size
    assert warm["cached"] == (len(ids) - 1) // bs * bs


def test_burst_shares_its_common_prefix_within_one_step(tiny_engine, chat_prompts, tiny_reference):
    """Requests admitted in the same step reuse the blocks an earlier one of them is computing."""
    _check_burst(tiny_engine, chat_prompts, tiny_reference)


def test_burst_sharing_on_the_torch_attention_path(tiny_llama, eos, chat_prompts, tiny_reference):
    """The same through torch SDPA (no C kernels): a sharing sequence reads its prefix from the cache."""
    eng = make_tiny_engine(tiny_llama, eos, backend="sdpa")
    try:
        _check_burst(eng, chat_prompts, tiny_reference)
    finally:
        eng.shutdown()


def _check_burst(engine: LLMEngine, chat_prompts, reference: list[list[int]]) -> None:
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
    assert [tokens[rid] for rid in ids] == reference
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


def test_tiny_kv_cache_preempts_and_still_matches(tiny_llama, eos, chat_prompts, tiny_reference):
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~60 tokens at once: preemption must happen.
    eng = make_tiny_engine(tiny_llama, eos, num_blocks_override=12)
    try:
        got = eng.generate(chat_prompts, GREEDY)
        assert eng.scheduler.num_preemptions > 0
        assert got == tiny_reference
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_abort_frees_every_block(tiny_engine, chat_prompts):
    engine = tiny_engine
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


def test_seeded_sampling_same_alone_and_in_busy_batch(tiny_engine, chat_prompts):
    engine = tiny_engine
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _run_one(engine, "seed-alone", chat_prompts[0], seeded)["tokens"]
    noisy = SamplingParams(temperature=1.0, max_tokens=20)
    for i, ids in enumerate(chat_prompts[1:]):
        engine.add_request(f"noise-{i}", ids, noisy)
    busy = _run_one(engine, "seed-busy", chat_prompts[0], seeded)["tokens"]
    assert busy == alone
    other = _run_one(engine, "seed-other", chat_prompts[0], SamplingParams(**{**seeded.__dict__, "seed": 99}))
    assert other["tokens"] != alone  # the seed really drives the draw


def test_tensor_parallel_2_greedy_matches(tiny_llama, eos, chat_prompts, tiny_reference, ray_local):
    """Two ranks (heads and MLP columns split, all-reduced) on the tiny model against transformers' alone."""
    eng = make_tiny_engine(tiny_llama, eos, tp=2)
    try:
        assert eng.generate(chat_prompts[:4], GREEDY) == tiny_reference[:4]
        # Each rank's process started with oneDNN's shape caches bounded (as the engine child's are).
        envs = ray.get([w.__ray_call__.remote(lambda self: {k: os.environ.get(k) for k in onednn_cache_env({})})
                              for w in eng.executor.workers])
        assert envs == [{k: os.environ.get(k, v) for k, v in onednn_cache_env({}).items()}] * 2
    finally:
        eng.shutdown()


def test_a_lone_sequence_gets_its_own_thread_count(tiny_llama, eos, chat_prompts):
    """cpu.threads_single_sequence applies to steps of one sequence only; batches use cpu.threads_per_rank.
    On the tiny model in bf16."""
    before = torch.get_num_threads()
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=tiny_llama, dtype="bfloat16"),
            cache=CacheConfig(kv_cache_bytes=TINY_CACHE),
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


def test_a_wide_step_gets_the_single_sequence_thread_count(tiny_llama, eos, chat_prompts):
    """cpu.wide_step_tokens: a step of that many tokens (prefill chunks) runs on cpu.threads_single_sequence
    threads; the same sequences' one-token decode steps stay on cpu.threads_per_rank. On the tiny model in bf16."""
    before = torch.get_num_threads()
    wide = len(chat_prompts[0]) + len(chat_prompts[1])  # both prompts in the first step
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=tiny_llama, dtype="bfloat16"),
            cache=CacheConfig(kv_cache_bytes=TINY_CACHE, enable_prefix_caching=False),
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


def test_steps_in_two_halves_match_transformers(tiny_llama, eos, tiny_hf_model, chat_prompts, tiny_reference):
    """cpu.half_step_tokens: steps of that many tokens run their sequences in two halves on two threads
    (split_step.py), prefill chunks and decode batches; every output still equals transformers' alone,
    including a burst whose later requests attend to prefix blocks the first one fills in that step.
    A step that runs whole computes its LM head in two halves of the vocabulary, one on each thread.
    On the tiny model (its vocabulary is the real one's, so the halves are the same size)."""
    before = torch.get_num_threads()
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(model=tiny_llama, dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=TINY_CACHE),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
            parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1, half_step_tokens=4)),
        ),
        eos_token_ids=eos,
    )
    try:
        halves = eng.executor.worker.runner.halves
        assert halves is not None
        assert eng.generate(chat_prompts, GREEDY) == tiny_reference
        assert halves.steps > 0
        steps = halves.steps
        _check_burst(eng, chat_prompts, tiny_reference)
        assert halves.steps > steps
        # One prompt alone runs whole: its logits at every position come from the two vocabulary halves.
        calls = halves.lm_head_calls
        got = eng.executor.worker.score(chat_prompts[0])
        assert halves.lm_head_calls == calls + 1
        with torch.no_grad():
            expected = tiny_hf_model(torch.tensor([chat_prompts[0]])).logits[0]
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    finally:
        eng.shutdown()
        torch.set_num_threads(before)


def test_timings_mark_the_queue_prefill_and_decode_steps(tiny_engine, chat_prompts):
    """EngineTimings (the engine's spans when tracing is on) fall in the steps where each phase ended: the
    first scheduling in an earlier step than the first token when the prompt is prefilled in chunks."""
    import time

    engine = tiny_engine

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


def test_an_abort_acknowledges_with_the_timings_of_the_phases_reached(tiny_engine, chat_prompts):
    """The abort's output (what the replica traces after a stop string or a client gone) carries the
    sequence's timestamps up to the abort, 0 for the phases it never reached: one aborted while queued, one
    in its prefill (its prompt is chunked), one while decoding."""
    import time

    engine = tiny_engine

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
