"""`engine_bench.py --tp N`: tensor parallel on CPU, once per all-reduce backend (`--cpu-allreduce`), same run.

Two JSON lines kinds, each naming its backend:
- `"bench": "allreduce"`: microseconds (median and mean) per TP all-reduce of a [rows, hidden] activation,
  timed in N fresh processes through rayllm.distributed.allreduce (no model, no Ray): what one decode step pays
  2 x layers + 1 times.
- `"bench": "engine_tp"`: the engine at TP=N (Ray actors, one per rank): median decode step time of a
  batch of chat prompts and generate tokens/s, rounds alternating between the backends' engines.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayllm.distributed.allreduce import make_all_reduce
from rayllm.engine.engine import LLMEngine
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _time_allreduce(rank: int, world: int, init: str, backend: str, dtype: torch.dtype, shapes: list[tuple[int, int]],
                    iters: int, threads: int, out) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    name, reduce = make_all_reduce(backend, torch.device("cpu"), dtype, rank, world, dist.group.WORLD)
    result = {}
    for shape in shapes:
        x = torch.randn(*shape).to(dtype)
        for _ in range(20):
            reduce(x)
        dist.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            reduce(x)
            times.append(time.perf_counter() - t0)
        # A spinning kernel is fast until a peer is descheduled: the mean shows those stalls, p50 not.
        result[f"{shape[0]}x{shape[1]}"] = {"p50": round(statistics.median(times) * 1e6, 1),
                                            "mean": round(statistics.fmean(times) * 1e6, 1)}
    if rank == 0:
        out.put((name, result))
    dist.destroy_process_group()


def allreduce_us(backend: str, world: int, dtype: torch.dtype, shapes: list[tuple[int, int]], iters: int,
                 threads: int) -> tuple[str, dict[str, dict[str, float]]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(_time_allreduce, args=(world, init, backend, dtype, shapes, iters, threads, out),
                       nprocs=world, start_method="spawn")
    return out.get(timeout=60)


def decode_step_ms(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(median decode step ms once every prompt is prefilled, tokens/s of the whole generate)."""
    engine.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, ids in enumerate(batch):
        engine.add_request(f"tp-{i}", ids, params)
    times, start = [], time.perf_counter()
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    return statistics.median(times[1:]) * 1e3, len(batch) * new_tokens / elapsed


def bench_tp(args, path: str, prompts) -> None:
    import ray

    backends = args.cpu_allreduce.split(",")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.tp)

    def common() -> dict:
        return {"tp": args.tp, "device": f"cpu ({os.cpu_count()} cores)", "threads_per_rank": threads,
                "load_avg_1m": round(os.getloadavg()[0], 1)}

    print("engine bench --tp: the machine's load average is in every line (shared machines skew both backends)",
          file=sys.stderr)
    shapes = [(1, 576), (16, 576), (64, 576), (512, 576)]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for _ in range(args.rounds):
            for backend in backends:
                name, us = allreduce_us(backend, args.tp, dtype, shapes, iters=500, threads=threads)
                print(json.dumps(common() | {"bench": "allreduce", "cpu_allreduce": name, "dtype": dtype_name,
                                           "us_per_allreduce": us}), flush=True)
    ray.init(num_cpus=args.tp * len(backends), include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    batches = [int(b) for b in args.batches.split(",")]
    for dtype_name in args.dtypes.split(","):
        engines = {b: LLMEngine(EngineConfig(
            model=ModelConfig(model=path, dtype=dtype_name),
            cache=CacheConfig(kv_cache_bytes=512 << 20),
            scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048),
            parallel=ParallelConfig(device="cpu", tensor_parallel_size=args.tp,
                                    cpu=CpuConfig(allreduce=b, threads_per_rank=args.threads)))) for b in backends}
        for size in batches:
            batch = prompts(size)
            runs: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
            for _ in range(args.rounds):  # alternate, so drifting machine load hits both
                for b, engine in engines.items():
                    runs[b].append(decode_step_ms(engine, batch, args.new_tokens))
            for b in backends:
                print(json.dumps(common() | {
                    "bench": "engine_tp", "cpu_allreduce": b, "dtype": dtype_name, "batch": size,
                    "new_tokens": args.new_tokens, "rounds": args.rounds,
                    "decode_step_ms": round(min(ms for ms, _ in runs[b]), 2),
                    "tok_s": round(max(t for _, t in runs[b]), 1),
                    "decode_step_ms_runs": [round(ms, 2) for ms, _ in runs[b]],
                }), flush=True)
        for engine in engines.values():
            engine.shutdown()
    ray.shutdown()
