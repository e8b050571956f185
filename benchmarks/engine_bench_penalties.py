"""`engine_bench.py --workload penalties`: decode steps of penalised requests with a long history (session 40).

`--requests` (16) random prompts of `--prompt-tokens` (1500) tokens, all running at once; after every prompt
is prefilled, each engine step is one decode token per request, and its wall time is recorded. Variants,
alternating `--rounds` times on one engine, each reporting its median step over its best round:
- `plain`: greedy, no penalties (the model's step alone);
- `penalised`: greedy with presence 0.5, frequency 0.5 and repetition 1.1, as the engine runs now (only the
  new token per step reaches the driver's penalty state);
- `resend`: the same penalties, but every step sends each sequence's whole history with history_start 0, so
  the driver rebuilds its rows each step from O(length) tokens: the traffic and per-step work before session
  40. (On code without history_start this is `penalised`.)
The default model (or `--model`), or with `--shape S` a model of that shape with random weights. One JSON
line per variant; `penalty_ms` is its median step less `plain`'s, `sample_ms` the median time in the driver's sampler.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time

import torch
from engine_bench_shape import random_model
from engine_bench_workloads import commit, mixed_requests

from rayllm.engine.engine import LLMEngine
from rayllm.loader.model_files import default_model_path
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


def _resend(engine: LLMEngine) -> None:
    """Every step a full rebuild of each penalised sequence's row: the whole history from position 0."""
    build = engine._seq_step

    def seq_step(sc):
        step = build(sc)
        if step.history is not None and hasattr(step, "history_start"):
            step.history, step.history_start = sc.seq.token_ids, 0
        return step

    engine._seq_step = seq_step  # type: ignore[method-assign]


def _timed_sampler(engine: LLMEngine) -> list[float]:
    """The driver's sampler, timed: each call's seconds are appended to the list returned (the call ends
    with the chosen ids on the host, so on CUDA too it is the sampler's whole time)."""
    sampling = engine.executor.worker.runner.sampling
    sample, seconds = sampling.sample, []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    sampling.sample = timed
    return seconds


def _decode_steps(engine: LLMEngine, sampler: list[float], prompts: list[list[int]],
                  params: SamplingParams) -> tuple[list[float], list[float]]:
    """Seconds of each step, and of its sampling, after every request has its first token (decode steps of
    the whole batch)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"pen-{time.monotonic_ns()}-{i}", p, params)
    started: set[str] = set()
    steps: list[float] = []
    sampling: list[float] = []
    while engine.has_work():
        t0 = time.perf_counter()
        sampler.clear()
        outs = engine.step()
        if len(started) == len(prompts):
            steps.append(time.perf_counter() - t0)
            sampling.append(sum(sampler))
        started |= {o.request_id for o in outs if o.new_token_ids}
    return steps, sampling


def bench_penalties(args) -> None:
    dtype = args.dtypes.split(",")[0]
    n, length, new = args.penalty_requests, args.penalty_prompt_tokens, args.new_tokens
    with tempfile.TemporaryDirectory() as folder:
        path = args.model or default_model_path()
        if args.shape:
            random_model(args.shape, getattr(torch, dtype), args.device, folder)
            path = folder
        mk = lambda: LLMEngine(EngineConfig(  # noqa: E731
            model=ModelConfig(model=path, dtype=dtype, max_model_len=length + new + 16),
            cache=CacheConfig(kv_cache_bytes=2 << 30, enable_prefix_caching=False,
                              gpu_memory_utilization=args.gpu_memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=args.max_num_batched_tokens),
            parallel=ParallelConfig(device=args.device, cpu=CpuConfig(threads_per_rank=args.threads))), eos_token_ids=[])
        engine, resend = mk(), mk()
        _resend(resend)
        engines = {"plain": engine, "penalised": engine, "resend": resend}
        timers = {id(e): _timed_sampler(e) for e in (engine, resend)}
        vocab = engine.arch.vocab_size
        prompts = [p for p, _ in mixed_requests(n, (length, length), (1, 1), vocab, args.seed)]
        params = {"plain": SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                  "penalised": SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, **PENALTIES),
                  "resend": SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, **PENALTIES)}
        try:
            for e in (engine, resend):
                e.generate(prompts[:2], params["penalised"])  # warm-up
            runs: dict[str, list[float]] = {v: [] for v in params}
            sample_runs: dict[str, list[float]] = {v: [] for v in params}
            outputs: dict[str, list[list[int]]] = {}
            for _ in range(args.rounds):
                for variant, p in params.items():
                    steps, sampling = _decode_steps(engines[variant], timers[id(engines[variant])], prompts, p)
                    runs[variant].append(statistics.median(steps))
                    sample_runs[variant].append(statistics.median(sampling))
            for variant, p in params.items():
                outputs[variant] = engines[variant].generate(prompts[:4], SamplingParams(
                    **{**p.__dict__, "max_tokens": 48}))
            base = min(runs["plain"])
            for variant in params:
                best = min(runs[variant])
                print(json.dumps({
                    "bench": "engine_penalties", "commit": commit(), "device": args.device, "dtype": dtype,
                    "model": args.shape or path, "random_weights": bool(args.shape), "vocab": vocab,
                    "requests": n, "prompt_tokens": length, "new_tokens": new, "variant": variant,
                    "step_ms": round(best * 1e3, 3), "penalty_ms": round((best - base) * 1e3, 3),
                    "runs_ms": [round(x * 1e3, 3) for x in runs[variant]],
                    "sample_ms": round(min(sample_runs[variant]) * 1e3, 3),  # the driver's sampler in the step
                    "sample_runs_ms": [round(x * 1e3, 3) for x in sample_runs[variant]],
                    "threads": torch.get_num_threads(),
                    "same_tokens_as_penalised": outputs[variant] == outputs["penalised"],
                    # compare across runs (the code before session 40 against after): equal digests, equal tokens
                    "tokens_sha": hashlib.sha256(json.dumps(outputs[variant]).encode()).hexdigest()[:16]}), flush=True)
        finally:
            engine.shutdown()
            resend.shutdown()


def _module_at(commit_ish: str, path: str, name: str):
    """`path` as it was at `commit_ish` (git show), imported as module `name` (its imports: today's package)."""
    import importlib.util
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{commit_ish}:{path}"], capture_output=True, text=True, check=True,
                            cwd=root).stdout
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, f"{commit_ish}:{path}", "exec"), module.__dict__)
    return module


def bench_sampler(args) -> None:
    """The driver's sampler alone over `--new-tokens` decode steps of `--penalty-requests` penalised rows with
    `--penalty-prompt-tokens`-token prompts: this code (one new token per row per step) against
    rayllm/sample/sampling_inputs.py at `--sampler-baseline` (the whole history every step), the two
    interleaved step by step on the same logits, in one process; their chosen tokens must be equal."""
    from rayllm.sample.sampling_inputs import SamplingInputs
    from rayllm.schema.step import SeqStep

    if args.threads:
        torch.set_num_threads(args.threads)
    old = _module_at(args.sampler_baseline, "rayllm/sample/sampling_inputs.py", "baseline_sampling_inputs")
    device = torch.device(args.device)
    n, length = args.penalty_requests, args.penalty_prompt_tokens
    for vocab in (int(v) for v in args.sampler_vocabs.split(",")):
        gen = torch.Generator().manual_seed(args.seed)
        params = SamplingParams(temperature=0.0, **PENALTIES)
        history = [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]
        ours, theirs = SamplingInputs(vocab), old.SamplingInputs(vocab)
        times: dict[str, list[float]] = {"after": [], "before": []}
        for step in range(args.new_tokens + 3):  # 3 warm-up steps
            logits = torch.randn(n, vocab, generator=gen).to(device, torch.bfloat16)
            start = 0 if step == 0 else len(history[0]) - 1
            new = [SeqStep(f"r{i}", [h[-1]], len(h) - 1, [0], True, params=params, num_prompt_tokens=length,
                           history=h[start:], history_start=start) for i, h in enumerate(history)]
            full = [SeqStep(f"r{i}", [h[-1]], len(h) - 1, [0], True, params=params, num_prompt_tokens=length,
                            history=list(h)) for i, h in enumerate(history)]
            picked = {}
            for side, sampler, seqs in (("after", ours, new), ("before", theirs, full))[:: 1 if step % 2 else -1]:
                t0 = time.perf_counter()
                picked[side] = sampler.sample(seqs, logits).sampled
                if step >= 3:
                    times[side].append(time.perf_counter() - t0)
            assert picked["after"] == picked["before"], step
            for i, h in enumerate(history):
                h.append(picked["after"][f"r{i}"])
        print(json.dumps({
            "bench": "sampler_penalties", "commit": commit(), "baseline": args.sampler_baseline, "device": args.device,
            "vocab": vocab, "requests": n, "prompt_tokens": length, "steps": args.new_tokens,
            "threads": torch.get_num_threads(), "same_tokens": True,
            **{f"{side}_ms": round(statistics.median(t) * 1e3, 3) for side, t in times.items()},
            **{f"{side}_min_ms": round(min(t) * 1e3, 3) for side, t in times.items()}}), flush=True)
