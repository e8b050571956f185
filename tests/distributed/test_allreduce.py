"""The CPU tensor-parallel all-reduce (rayllm/distributed/allreduce.py): the shared-memory kernel
(rayllm/platforms/cpu/csrc/shm_allreduce.c) sums exactly what gloo sums, leaves no segment behind, and a TP=2
engine on it computes what TP=2 on gloo and TP=1 compute (on the tiny random model of tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayllm.distributed.allreduce import make_all_reduce
from rayllm.engine.engine import LLMEngine
from rayllm.platforms.cpu.shm_allreduce import ShmAllReduce
from rayllm.schema.config import CacheConfig, CpuConfig, EngineConfig, ModelConfig, ParallelConfig
from rayllm.schema.sampling_params import SamplingParams
from tests.ports import free_port

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"rayllm-allreduce-{os.getuid()}-")}


def _sums(rank: int, world: int, init: str) -> None:
    """In each rank's process: the kernel's sum equals gloo's, bit for bit, on every path it has, in fp32 and
    in bf16 (a kernel of its own for each, as an engine of that dtype sets up; one pair of processes for both,
    which costs less than the sums)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            before = _segments()
            backend, reduce = make_all_reduce("shm", torch.device("cpu"), dtype, rank, world, dist.group.WORLD)
            assert backend == "shm"
            g = torch.Generator().manual_seed(rank)
            # One decode row and 64 rows (the small path: every rank sums all); 1,024 rows (the large path: each
            # rank sums its share); more than a 2 MiB slot (chunks, several rounds), a size no chunk divides; a
            # transposed (non-contiguous) view and float64, which go through gloo. Repeated, so rounds reuse
            # both buffers many times over.
            cases = [torch.randn(1, 576, generator=g), torch.randn(64, 576, generator=g),
                     torch.randn(1024, 576, generator=g), torch.randn((9 << 20) + 7, generator=g)] * 3
            cases = [c.to(dtype) for c in cases] + [torch.randn(576, 64, generator=g).to(dtype).t(),
                                                    torch.randn(100, generator=g, dtype=torch.float64)]
            for x in cases:
                expected = x.clone()
                dist.all_reduce(expected)
                got = reduce(x)
                assert got.data_ptr() == x.data_ptr()  # in place
                assert torch.equal(got, expected), (tuple(x.shape), x.dtype)
            dist.barrier()
            assert _segments() <= before  # unlinked once every rank had mapped it
    finally:
        dist.destroy_process_group()


def test_shm_kernel_sums_what_gloo_sums():
    mp.spawn(_sums, args=(2, f"tcp://127.0.0.1:{free_port()}"), nprocs=2)


def _attach(name: str, rank: int, world: int, timeout_s: float) -> ShmAllReduce:
    """The kernel on a segment of its own (rank 0 creates, the others map, rank 0 unlinks), as
    rayllm.distributed.allreduce sets one up."""
    if rank == 0:
        kernel = ShmAllReduce(name, rank, world, create=True, slot_bytes=1 << 16, timeout_s=timeout_s)
    dist.barrier()
    if rank != 0:
        kernel = ShmAllReduce(name, rank, world, create=False, slot_bytes=1 << 16, timeout_s=timeout_s)
    dist.barrier()
    if rank == 0:
        os.unlink(f"/dev/shm/{name}")
    return kernel


def _three(rank: int, world: int, init: str, name: str) -> None:
    """Three ranks on the kernel directly: every rank holds the same bits, the rank-order fp32 sum (bf16: that
    sum rounded once), for shares of uneven size; then rank 2 exits and the others' next call says so at once
    (not after the time limit: gloo sees a dead peer's socket close, this kernel checks the pids it waits for)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    kernel = _attach(name, rank, world, timeout_s=60.0)
    parts = [torch.randn(100_003, generator=torch.Generator().manual_seed(k)) for k in range(world)]
    for dtype in (torch.float32, torch.bfloat16):
        mine = parts[rank].to(dtype)
        want = (parts[0].to(dtype).float() + parts[1].to(dtype).float() + parts[2].to(dtype).float()).to(dtype)
        got = kernel(mine.clone())
        assert torch.equal(got, want), dtype
        everyone = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(everyone, got)
        assert all(torch.equal(e, got) for e in everyone)
    dist.barrier()
    if rank == 2:
        os._exit(0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a peer of rank .* exited"):
        kernel(torch.ones(8))
    assert time.monotonic() - t0 < 30
    with pytest.raises(RuntimeError, match="out of step"):  # never again on a group out of step
        kernel(torch.ones(8))


def test_three_ranks_agree_bit_for_bit_and_a_dead_peer_is_an_error():
    name = f"rayllm-allreduce-{os.getuid()}-test-{os.getpid()}"
    mp.spawn(_three, args=(3, f"tcp://127.0.0.1:{free_port()}", name), nprocs=3)
    assert not os.path.exists(f"/dev/shm/{name}")


def _silent(rank: int, world: int, init: str, name: str) -> None:
    """A live peer that never calls: the waiting rank gives up after its time limit."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        kernel = _attach(name, rank, world, timeout_s=1.0)
        if rank == 0:
            with pytest.raises(RuntimeError, match="did not arrive within 1 s"):
                kernel(torch.ones(8))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_peer_that_never_arrives_is_an_error_after_the_time_limit():
    mp.spawn(_silent, args=(2, f"tcp://127.0.0.1:{free_port()}", f"rayllm-allreduce-{os.getuid()}-silent-{os.getpid()}"),
             nprocs=2)


def _auto(rank: int, world: int, init: str) -> None:
    """`auto` takes the shared-memory kernel for ranks on one host, whatever the cores left beside them (one
    thread a rank, then every core a rank; for the dtypes it has a path for)."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for threads in (1, len(os.sched_getaffinity(0))):
            torch.set_num_threads(threads)
            backend, reduce = make_all_reduce("auto", torch.device("cpu"), torch.float32, rank, world, dist.group.WORLD)
            assert backend == "shm", threads
            assert torch.equal(reduce(torch.full((8,), rank + 1.0)), torch.full((8,), 3.0))
            # fp16 models: the kernel has no fp16 path, so every all-reduce would go through gloo: named so.
            assert make_all_reduce("auto", torch.device("cpu"), torch.float16, rank, world, dist.group.WORLD)[0] == "gloo"
    finally:
        dist.destroy_process_group()


def test_auto_takes_shm_on_one_host():
    mp.spawn(_auto, args=(2, f"tcp://127.0.0.1:{free_port()}"), nprocs=2)


def _backend(engine: LLMEngine) -> list[str]:
    import ray

    workers = engine.executor.workers
    return ray.get([w.__ray_call__.remote(lambda worker: worker.allreduce_backend) for w in workers])


def test_tp2_on_shm_matches_gloo_and_tp1(tiny_llama, tiny_hf_model, eos, hf_tokenizer, chat_prompts, ray_local):
    """The tiny random model (tests/conftest.py) in fp32: logits of a prompt and greedy continuations of two
    chat prompts; TP=1's logits are transformers' own on the same checkpoint."""
    base = EngineConfig(model=ModelConfig(model=tiny_llama, dtype="float32"), cache=CacheConfig(kv_cache_bytes=16 << 20),
                        parallel=ParallelConfig(device="cpu"))
    ids = hf_tokenizer("The capital of France is Paris. The capital of Germany is", add_special_tokens=False).input_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    results = {}
    for name, tp, choice in [("tp1", 1, "auto"), ("gloo", 2, "gloo"), ("shm", 2, "shm")]:
        config = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tensor_parallel_size=tp,
                                                                        cpu=CpuConfig(allreduce=choice)))
        engine = LLMEngine(config, eos_token_ids=eos)
        try:
            if tp > 1:
                assert _backend(engine) == [name, name]
            results[name] = (engine.executor.score(ids), engine.generate(chat_prompts[:2], greedy))
        finally:
            engine.shutdown()
    logits, tokens = results["shm"]
    # Two ranks sum the same two fp32 partials in either backend: identical, not merely close.
    assert torch.equal(logits, results["gloo"][0])
    torch.testing.assert_close(logits, results["tp1"][0], atol=2e-3, rtol=1e-3)
    assert tokens == results["gloo"][1] == results["tp1"][1]
    # The engines compute the model (random weights: no answer to check, as "Berlin" was on the real one).
    with torch.no_grad():
        expected = tiny_hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(results["tp1"][0], expected, atol=2e-3, rtol=1e-3)
    assert int(logits[-1].argmax()) == int(expected[-1].argmax())
