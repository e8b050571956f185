"""Both engine clients (rayllm/engine/client/engine_client.py), an engine on a thread and one in a child process,
serve the same outputs as `LLMEngine` run offline, end aborted requests, and report stats and health.
What crosses a thread or a pipe does not depend on what the model says: conftest's tiny_llama (RANDOM weights,
the default model's vocabulary and end ids, so chat_prompts are valid inputs), in float32 so batch composition
cannot change a greedy token."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from rayllm.engine.client.engine_client import (
    EngineClient,
    InprocClient,
    ProcessClient,
    make_engine_client,
    steps_in_child,
)
from rayllm.engine.engine import EngineStats, LLMEngine
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.outputs import EngineDeadError
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16)


def config(model: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype="float32", max_model_len=1024),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
        parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1)),
    )


@pytest.fixture(scope="module")
def offline(tiny_llama, eos, chat_prompts) -> tuple[LLMEngine, list[list[int]]]:
    """An LLMEngine and what it generates offline for the first four prompts (the last one seeded)."""
    engine = LLMEngine(config(tiny_llama), eos_token_ids=eos)
    return engine, engine.generate(chat_prompts[:4], [GREEDY, GREEDY, GREEDY, SEEDED])


@pytest.fixture(scope="module", params=["thread", "process"])
def client(request, tiny_llama, eos, offline):
    if request.param == "thread":  # the offline engine itself, now driven by the client's thread
        engine: EngineClient = InprocClient(offline[0])
    else:
        engine = make_engine_client(config(tiny_llama), eos, own_process=True)
        assert isinstance(engine, ProcessClient)
    yield engine
    engine.shutdown()


async def collect(engine: EngineClient, rid: str, prompt: list[int], params: SamplingParams):
    tokens: list[int] = []
    last = None
    async for out in engine.generate(rid, prompt, params):
        tokens += out.new_token_ids
        last = out
    return tokens, last


def idle(stats: EngineStats) -> bool:
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0


def test_outputs_equal_the_offline_engine(client, offline, chat_prompts):
    prompts = chat_prompts[:4]

    async def run():
        return await asyncio.gather(*[collect(client, f"same{i}", p, SEEDED if i == 3 else GREEDY)
                                      for i, p in enumerate(prompts)])

    results = asyncio.run(run())
    assert [tokens for tokens, _ in results] == offline[1]
    assert all(last.finished and last.num_prompt_tokens == len(p) for (_, last), p in zip(results, prompts, strict=True))
    assert client.vocab_size == offline[0].arch.vocab_size
    assert (client.max_model_len, client.capacity_tokens) == (1024, offline[0].capacity_tokens)


def test_abort_ends_the_stream_and_frees_its_blocks(client, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def run():
        tokens = 0
        outs = []
        async for out in client.generate("to-abort", chat_prompts[1], params):
            tokens += len(out.new_token_ids)
            outs.append(out)
            if len(outs) == 1:
                client.abort("to-abort")
        # A consumer that leaves early aborts its request too.
        gen = client.generate("left", chat_prompts[2], params)
        await anext(gen)
        await gen.aclose()
        return tokens, outs[-1]

    tokens, last = asyncio.run(run())
    assert last.finished and last.finish_reason == "abort" and tokens < 200
    assert idle(client.stats())  # commands reach the engine in order: the stats call comes after both aborts


def test_stats_health_and_refusals(client, chat_prompts):
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(collect(client, "too-long", chat_prompts[0], SamplingParams(max_tokens=4000)))
    client.check_health()
    steps_before = client.stats().num_steps
    asyncio.run(collect(client, "counted", chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    stats = client.stats()
    # A prefill and two decode steps at least (the stats call reaches the engine after the request ended).
    assert isinstance(stats, EngineStats) and stats.num_steps >= steps_before + 3 and idle(stats)
    assert (stats.device_uuid, stats.device_reserved_bytes) == ("", 0)  # a CPU engine holds no GPU


def test_a_stopped_client_refuses_calls(tiny_llama, eos):
    engine = make_engine_client(config(tiny_llama), eos)
    assert isinstance(engine, InprocClient) and not engine.in_child_process
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        engine.stats()
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_the_factory_runs_only_single_rank_default_engines_in_a_child(tiny_llama):
    base = config(tiny_llama)
    tp2 = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tensor_parallel_size=2))
    ray = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, executor="ray"))
    assert steps_in_child(base, True) and not steps_in_child(base, False)
    assert not steps_in_child(tp2, True) and not steps_in_child(ray, True)


def test_on_end_gets_the_last_output_also_after_the_consumer_left(client, chat_prompts):
    """generate's on_end (the replica's tracing) is called once per request with the engine's last output and
    its timings: a finished request's before that output is yielded; for a consumer that leaves early (a stop
    string), the abort's acknowledgement, after the iterator closed; for one that leaves once the engine had
    already finished it, that finished output. Without on_end nothing waits for an acknowledgement."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ends: dict[str, list] = {"done": [], "left": [], "late": []}

    async def run():
        seen = []
        async for out in client.generate("done", chat_prompts[0], GREEDY, on_end=ends["done"].append):
            seen.append((out.finished, len(ends["done"])))
        assert seen[-1] == (True, 1) and all(n == 0 for _, n in seen[:-1])  # before the last is yielded

        async with contextlib.aclosing(client.generate("left", chat_prompts[1], params,
                                                       on_end=ends["left"].append)) as gen:
            await anext(gen)
            await anext(gen)
        assert ends["left"] == []  # the abort is on its way
        for _ in range(600):  # the acknowledgement comes after the engine's current step
            if ends["left"]:
                break
            await asyncio.sleep(0.05)

        short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        gen = client.generate("late", chat_prompts[2], short, on_end=ends["late"].append)
        if not (await anext(gen)).finished:  # (both tokens may have come merged)
            while client._queues["late"].empty():  # the engine finishes it while nobody reads
                await asyncio.sleep(0.01)
        await gen.aclose()

        plain = client.generate("plain", chat_prompts[3], params)
        await anext(plain)
        await plain.aclose()
        assert client._ends == {}

    asyncio.run(run())
    (done,), (left,), (late,) = ends["done"], ends["left"], ends["late"]
    assert done.finished and done.finish_reason in ("stop", "length")
    assert left.request_id == "left" and left.finish_reason == "abort" and left.new_token_ids == []
    assert late.finish_reason == "length" and late.new_token_ids  # the unread last output itself
    for out in (done, left, late):
        t = out.timings
        assert 0 < t.arrival_ns <= t.scheduled_ns <= t.first_token_ns <= t.finished_ns
    assert client._ends == {} and idle(client.stats())
