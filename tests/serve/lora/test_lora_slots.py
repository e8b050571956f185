"""Every LoRA slot held by running requests: a request for another adapter waits for a slot (vLLM keeps it
waiting too), lower priority first and then in arrival order, for a bounded time, then a 503 with Retry-After;
a request that leaves while it waits holds nothing (rayllm/serve/lora/lora_registry.py).

Real model (SmolLM2 GGUF), random PEFT adapters, the replica's own LLMServer class driven directly (no Ray
Serve around it), its engine in a thread; the 503's way through Ray is its pickling, checked here too.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest

from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerateRequest, StopOptions
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams
from rayllm.serve.llm_server import LLMServer
from rayllm.serve.lora.registry_errors import SlotsBusy

pytestmark = [pytest.mark.slow, pytest.mark.engine_only]  # the real model, no Ray


@pytest.fixture(scope="module")
def adapters(gguf_path, tmp_path_factory) -> dict[str, str]:
    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter

    arch = read_arch(gguf_path)
    root = tmp_path_factory.mktemp("slot-adapters")
    return {name: random_peft_adapter(str(root / name), arch, rank=4, seed=seed, targets=("q_proj", "v_proj"))
            for seed, name in enumerate("abcde")}


@pytest.fixture
def server(gguf_path, adapters):
    """One slot; the priority policy, so that requests' priority orders the wait for it."""
    root = str(next(iter(adapters.values())).rsplit("/", 1)[0])
    config = EngineConfig(model=ModelConfig(model=gguf_path, dtype="float32", max_model_len=256),
                          cache=CacheConfig(kv_cache_bytes=16 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, policy="priority"),
                          parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1)),
                          lora=LoRAConfig(max_loras=1, max_lora_rank=4, allowed_roots=(root,)))
    server = LLMServer(config, gguf_path, engine_process=False)
    yield server
    server.engine.shutdown()


def request(rid: str, name: str, path: str, max_tokens: int = 4, priority: int = 0) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
    return GenerateRequest(rid, [[1, 2, 3, 4]], params, StopOptions(), lora=name, lora_path=path)


async def run(server: LLMServer, req: GenerateRequest, order: list[str] | None = None) -> list[int]:
    tokens: list[int] = []
    async for batch in server.generate(req):
        if order is not None and not tokens:
            order.append(req.request_id)  # its first tokens: it holds the slot now
        for d in batch:
            tokens.extend(d.token_ids)
    return tokens


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


async def test_requests_wait_for_a_slot_in_priority_then_arrival_order(server, adapters):
    registry = server.loras
    solo = {n: await run(server, request(f"solo-{n}", n, adapters[n])) for n in "bcd"}
    held = await registry.acquire("a", adapters["a"])  # a request of adapter a, running: the only slot is in use
    order: list[str] = []
    # Arrival order b, c, d, e; priorities 5, 0, 0, (e leaves): c then d (equal priority: arrival), then b.
    waiting = {n: asyncio.create_task(run(server, request(n, n, adapters[n], priority=p), order))
               for n, p in (("b", 5), ("c", 0), ("d", 0))}
    await settle()
    leaving = asyncio.create_task(run(server, request("e", "e", adapters["e"], priority=-1)))
    await settle()
    assert not any(t.done() for t in waiting.values()) and len(registry._waiters) == 4
    leaving.cancel()  # its client left while it waited: out of line, nothing loaded or held
    await settle()
    assert leaving.cancelled() and len(registry._waiters) == 3 and "e" not in registry.entries
    assert list(registry.entries) == ["a"] and held.active == 1
    registry.release(held)
    outputs = {n: await t for n, t in waiting.items()}
    assert order == ["c", "d", "b"]
    assert outputs == solo  # each waited, then ran with its own adapter's weights
    await settle()  # a request's slot is released once its choices' aborts are submitted
    assert not registry._waiters and all(e.active == 0 for e in registry.entries.values())


async def test_a_request_that_waits_past_the_bound_gets_503_with_retry_after(server, adapters):
    registry = server.loras
    registry.slot_wait_s = 0.5
    held = await registry.acquire("a", adapters["a"])
    with pytest.raises(APIError) as err:
        await run(server, request("b", "b", adapters["b"]))
    assert (err.value.status_code, err.value.code) == (503, "lora_slots_busy")
    assert err.value.headers == {"Retry-After": "5"}
    # Ray pickles it to the ingress, whose error handler sends its headers.
    again = pickle.loads(pickle.dumps(err.value))
    assert isinstance(again, SlotsBusy) and again.headers == err.value.headers
    assert (again.status_code, again.code, again.message) == (503, "lora_slots_busy", err.value.message)
    assert not registry._waiters and list(registry.entries) == ["a"]
    registry.release(held)
    # The slot's adapter idle now: the next request for another adapter evicts it at once.
    assert len(await run(server, request("b2", "b", adapters["b"]))) == 4
    assert list(registry.entries) == ["b"]


async def test_a_waiter_for_an_adapter_loaded_meanwhile_takes_it_without_a_slot(server, adapters):
    """Two requests of one adapter wait; the first loads it, the second then finds it resident."""
    registry = server.loras
    held = await registry.acquire("a", adapters["a"])
    tasks = [asyncio.create_task(run(server, request(f"b{i}", "b", adapters["b"], max_tokens=3)))
             for i in range(2)]
    await settle()
    assert len(registry._waiters) == 2
    registry.release(held)
    assert [len(await t) for t in tasks] == [3, 3]
    assert list(registry.entries) == ["b"] and not registry._waiters
