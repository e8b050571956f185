"""Unloading a LoRA adapter while requests use it: those requests end with a clear error, the slot is
freed only after the engine dropped their sequences, and the engine keeps serving everyone else.

Real model (SmolLM2 GGUF), a real PEFT adapter (saved by peft), the replica's own LLMServer class
driven directly (no Ray Serve around it), with the engine in a thread and in its own process.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from rayllm.lora.files import UnknownAdapterError
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

# The real model (`make test-fast` skips it), no Ray: `make test` runs it in its first pass.
pytestmark = [pytest.mark.slow, pytest.mark.engine_only]


@pytest.fixture(scope="module")
def peft_dir(hf_model, tmp_path_factory) -> str:
    """A rank-8 q/v adapter over the real model, random A and B (peft zeroes B), saved by peft itself (on a
    copy of the session's transformers model: peft adds its layers in place)."""
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    out = str(tmp_path_factory.mktemp("adapters") / "peft")
    peft_model.save_pretrained(out)
    return out


def request(rid: str, prompt: list[int], max_tokens: int, lora: str | None = None, path: str | None = None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid, [prompt], params, StopOptions(), lora=lora, lora_path=path)


async def run(server: LLMServer, req: GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for batch in server.generate(req):
        for d in batch:
            tokens.extend(d.token_ids)
    return tokens


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_unload_in_use_aborts_its_requests_and_the_engine_serves_on(gguf_path, chat_prompts, peft_dir,
                                                                          engine_process):
    config = EngineConfig(
        model=ModelConfig(model=gguf_path, dtype="float32", max_model_len=1024),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1)),
        lora=LoRAConfig(max_loras=1, max_lora_rank=8, allowed_roots=(os.path.dirname(peft_dir),)),
    )
    server = LLMServer(config, gguf_path, engine_process=engine_process)
    try:
        base_solo = await run(server, request("solo", chat_prompts[1], 24))
        await server.load_lora_adapter("a", peft_dir)
        adapter_solo = await run(server, request("a-solo", chat_prompts[0], 8, "a", peft_dir))
        assert adapter_solo != (await run(server, request("b-solo", chat_prompts[0], 8)))  # the adapter matters

        users = [asyncio.create_task(run(server, request(f"a{i}", chat_prompts[i], 400, "a", peft_dir)))
                 for i in range(3)]
        base = asyncio.create_task(run(server, request("base", chat_prompts[1], 24)))
        entry = server.loras.entries["a"]
        while entry.active < 3 or server.stats()["num_running"] < 4:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # a few steps with the adapter in the batch
        assert await server.unload_lora_adapter("a")  # returns once the slot is free
        assert "a" not in server.loras.entries and not any(t.done() and not t.exception() for t in users)
        for task in users:
            with pytest.raises(APIError) as err:
                await task
            assert err.value.status_code == 409 and err.value.code == "lora_adapter_unloaded"
        assert await base == base_solo  # the request beside them: exactly its solo output
        await server.check_health()
        assert server.engine.error is None
        stats = server.stats()  # the engine holds none of the aborted sequences
        assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0
        # The slot is reusable and the adapter loads again with the same effect.
        await server.load_lora_adapter("a", peft_dir)
        assert await run(server, request("a-again", chat_prompts[0], 8, "a", peft_dir)) == adapter_solo
        with pytest.raises(APIError) as err:  # outside the allowed roots: refused before any file is read
            await server.load_lora_adapter("x", os.path.dirname(os.path.dirname(peft_dir)))
        assert err.value.code == "invalid_lora_adapter"
    finally:
        server.engine.shutdown()


async def test_a_registered_adapter_the_replica_cannot_read_is_the_servers_503(gguf_path, tmp_path):
    """A request that named an adapter (not a path) is not told its `lora_path` is bad when the replica
    cannot read the server's own copy (removed, missing on its node, corrupt): a 503 naming the adapter.
    A resident adapter serves on from memory; a path the request itself sent is still its 400 on lora_path."""
    import shutil

    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter

    gone = random_peft_adapter(str(tmp_path / "gone"), read_arch(gguf_path), rank=4, seed=3, targets=("q_proj",))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("{not json")
    (corrupt / "adapter_model.safetensors").write_bytes(b"")
    config = EngineConfig(model=ModelConfig(model=gguf_path, dtype="float32", max_model_len=256),
                          cache=CacheConfig(kv_cache_bytes=8 << 20),
                          parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1)),
                          lora=LoRAConfig(max_loras=1, max_lora_rank=4, allowed_roots=(str(tmp_path),)))
    server = LLMServer(config, gguf_path, engine_process=False)
    try:
        await server.load_lora_adapter("gone", gone)  # the load route: registered, resident here
        shutil.rmtree(gone)
        assert len(await run(server, request("resident", [1, 2, 3], 2, "gone", gone))) == 2
        assert await server.unload_lora_adapter("gone")  # now this replica must read the files again
        for name, path in (("gone", gone), ("corrupt", str(corrupt))):
            with pytest.raises(APIError) as err:
                await run(server, request(f"r-{name}", [1, 2, 3], 2, name, path))
            assert (err.value.status_code, err.value.code, err.value.param) == (503, "lora_adapter_unavailable", None)
            assert repr(name) in err.value.message and str(tmp_path) not in err.value.message
        for sent in (lambda: run(server, request("on-demand", [1, 2, 3], 2, gone, gone)),  # a request's lora_path
                     lambda: server.load_lora_adapter("again", gone)):  # the load route's lora_path
            with pytest.raises(APIError) as err:
                await sent()
            assert (err.value.status_code, err.value.param) == (400, "lora_path")
    finally:
        server.engine.shutdown()


def test_a_step_naming_an_unloaded_adapter_is_that_sequences_error(gguf_path, peft_dir):
    """The LoRA manager names the adapter ids it does not hold, and leaves the batch state untouched,
    so the engine can fail just the sequences carrying them."""
    from rayllm.executor.executor import make_executor
    from rayllm.loader.loader import read_arch

    config = EngineConfig(model=ModelConfig(model=gguf_path, dtype="float32", max_model_len=256),
                          cache=CacheConfig(kv_cache_bytes=8 << 20), lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    executor = make_executor(config, gguf_path, read_arch(gguf_path))
    try:
        manager = executor.worker.lora
        manager.load(1, 5, peft_dir)
        manager.set_batch([5, 0], [3, 1])
        before = list(manager.batch.groups)
        with pytest.raises(UnknownAdapterError) as err:
            manager.set_batch([5, 9, 0], [1, 1, 1])
        assert err.value.lora_ids == {9} and manager.batch.groups == before
    finally:
        executor.shutdown()
