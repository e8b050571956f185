"""`engine_bench.py --shape S --workload mixed` and `--long-prompts 8000,32000`: the issue-33 rows, on a
model of that shape with RANDOM weights (outputs are meaningless, timings real), EOS ignored.

- mixed: `--requests` (512) requests submitted at once, prompts uniform in `--prompt-range` (128-1024)
  random tokens, outputs uniform in `--output-range` (64-256), all drawn from `--seed`; reports the wall
  time, total (prompt + output) and output tokens/s, time to first token p50/p99.
- long prompts: one request at a time of each length, one output token: time to first token (best of
  `--rounds`, each a fresh random prompt with the prefix cache emptied), prompt tokens/s.

Fraction of the limit (`fraction_of_limit` = limit seconds / measured seconds), for the detected device:
- FLOPs: 2 x the layers' weights per computed token, 2 x the LM head's per sampled token, and causal
  attention (QK^T and PV: 4 x position x head dim x query heads x layers per token), over the device's
  dense bf16 peak (`PEAK_BF16`; unknown devices and CPUs: no fraction);
- HBM: each of the longest request's output tokens needs its own step, and every step reads every
  weight once: max output x weight bytes / measured copy bandwidth.
The limit is the larger of the two (long prompts: FLOPs only). The first line printed is the settings
(device, commit, engine settings), and every result line repeats the device and commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import torch
from engine_bench_shape import SHAPES, copy_bandwidth, device_name, random_model

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

# Dense bf16 tensor-core peak, FLOP/s, from the vendors' data sheets (without sparsity), by name substring.
PEAK_BF16 = {"H200": 989.4e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989.4e12, "A100": 312e12}


def commit() -> str:
    """This checkout's commit, or RAYLLM_COMMIT where there is no git (the device machine's copy)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        if out.returncode == 0:
            return out.stdout.strip()
    except OSError:
        pass
    return os.environ.get("RAYLLM_COMMIT", "unknown")


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def mixed_requests(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                   seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, uniform in the inclusive ranges, seeded."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_range[0], prompt_range[1] + 1, (n,), generator=gen).tolist()
    outs = torch.randint(output_range[0], output_range[1] + 1, (n,), generator=gen).tolist()
    return [(torch.randint(0, vocab, (p,), generator=gen).tolist(), o) for p, o in zip(lens, outs, strict=True)]


def model_flops(shape: dict, prompt: int, output: int) -> float:
    """FLOPs to prefill `prompt` tokens and decode `output` more (the last prompt row samples the first)."""
    h, layers, hq = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    d = shape.get("head_dim", h // hq)
    hk, inter, vocab = shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]
    layer_weights = layers * (h * (hq + 2 * hk) * d + hq * d * h + 3 * h * inter)
    computed = prompt + output - 1  # the last sampled token is never fed back
    positions = computed * (computed + 1) // 2  # each token attends to itself and every key before it
    return 2 * layer_weights * computed + 2 * vocab * h * output + 4 * positions * d * hq * layers


def _engine(args, folder: str, block_size: int, max_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=folder, dtype=args.dtypes.split(",")[0], max_model_len=max_len),
        cache=CacheConfig(block_size=block_size, kv_cache_bytes=1 << 30,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_cache),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        parallel=ParallelConfig(device=args.device, cpu=CpuConfig(threads_per_rank=args.threads),
                                attention_backend=args.attention_backends.split(",")[0])), eos_token_ids=[])


def _run(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> tuple[float, list[float], int]:
    """All requests at once: (wall seconds, each request's time to first token, output tokens)."""
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i, (prompt, out) in enumerate(requests):
        engine.add_request(f"w{i}", prompt, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True))
    produced = 0
    while engine.has_work():
        for o in engine.step():
            if o.new_token_ids:
                produced += len(o.new_token_ids)
                first.setdefault(o.request_id, time.perf_counter() - t0)
    return time.perf_counter() - t0, sorted(first.values()), produced


def _pct(values: list[float], q: float) -> float:
    return round(values[min(len(values) - 1, int(q * len(values)))], 4) if values else 0.0


def bench_workloads(args) -> None:
    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtypes.split(",")[0])
    block_size = args.block_size or (64 if args.device == "cuda" else 16)
    lo_p, hi_p = (int(x) for x in args.prompt_range.split(","))
    lo_o, hi_o = (int(x) for x in args.output_range.split(","))
    longs = [int(x) for x in args.long_prompts.split(",") if x]
    max_len = max([hi_p + hi_o] * bool(args.workload) + [n + 1 for n in longs]) + block_size
    dev = device_name(args.device)
    peak = peak_flops(dev) if args.device == "cuda" else None
    common = {"bench": "engine_workload", "device": dev, "commit": commit(), "shape": args.shape,
              "random_weights": True}
    print(json.dumps(common | {"settings": {
        "dtype": str(dtype).removeprefix("torch."), "block_size": block_size, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "attention_backend": args.attention_backends.split(",")[0],
        "prefix_cache": not args.no_prefix_cache, "gpu_memory_utilization": args.gpu_memory_utilization,
        "workload": args.workload, "requests": args.requests, "prompt_range": [lo_p, hi_p],
        "output_range": [lo_o, hi_o], "seed": args.seed, "long_prompts": longs, "rounds": args.rounds,
        "peak_bf16_flops": peak, "torch": torch.__version__}}), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        hf = random_model(args.shape, dtype, args.device, folder)
        weight_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
        del hf
        bandwidth = copy_bandwidth(args.device) if args.device == "cuda" else None
        engine = _engine(args, folder, block_size, max_len)
        try:
            backend = getattr(getattr(engine.executor.worker, "attn_backend", None), "name", None)
            common["attention_backend"] = backend
            vocab = shape["vocab_size"]
            _run(engine, mixed_requests(2, (lo_p, lo_p), (2, 2), vocab, args.seed + 1))  # warm-up
            if args.workload == "mixed":
                requests = mixed_requests(args.requests, (lo_p, hi_p), (lo_o, hi_o), vocab, args.seed)
                engine.reset_prefix_cache()
                seconds, ttft, produced = _run(engine, requests)
                prompt_tokens = sum(len(p) for p, _ in requests)
                flops = sum(model_flops(shape, len(p), o) for p, o in requests)
                limits = [flops / peak if peak else 0.0,
                          max(o for _, o in requests) * weight_bytes / bandwidth if bandwidth else 0.0]
                limit = max(limits) or None
                print(json.dumps(common | {
                    "workload": "mixed", "requests": len(requests), "seconds": round(seconds, 3),
                    "prompt_tokens": prompt_tokens, "output_tokens": produced,
                    "total_tok_s": round((prompt_tokens + produced) / seconds, 1),
                    "output_tok_s": round(produced / seconds, 1), "ttft_p50_s": _pct(ttft, 0.5),
                    "ttft_p99_s": _pct(ttft, 0.99), "tflops": round(flops / seconds / 1e12, 2),
                    "limit_s": round(limit, 3) if limit else None, "limit_flops_s": round(limits[0], 3),
                    "limit_hbm_s": round(limits[1], 3),
                    "fraction_of_limit": round(limit / seconds, 3) if limit else None}), flush=True)
            for n in longs:
                runs = []
                for r in range(args.rounds):
                    engine.reset_prefix_cache()
                    prompt = mixed_requests(1, (n, n), (1, 1), vocab, args.seed + 100 + r)
                    seconds, _, _ = _run(engine, prompt)
                    runs.append(seconds)
                best = min(runs)
                flops = model_flops(shape, n, 1)
                print(json.dumps(common | {
                    "workload": "long_prompt", "prompt_tokens": n, "ttft_s": round(best, 4),
                    "ttft_runs_s": [round(x, 4) for x in runs], "prompt_tok_s": round(n / best, 1),
                    "tflops": round(flops / best / 1e12, 2),
                    "limit_s": round(flops / peak, 4) if peak else None,
                    "fraction_of_limit": round(flops / peak / best, 3) if peak else None}), flush=True)
        finally:
            engine.shutdown()
