"""`engine_bench.py --shape`: a model of a published shape with RANDOM weights (no download), ours against
transformers' `generate` in the same run; on CUDA also the batch-1 decode step against the HBM roofline
and, with `--profile DIR`, torch.profiler tables of decode steps.

    python benchmarks/engine_bench.py --device cuda --shape llama-3.1-8b --dtypes bfloat16 \
        --batches 1,16,64,256 --new-tokens 128 --rounds 1 [--profile DIR]

transformers runs eagerly with its static KV cache (`disable_compile`: its automatic torch.compile of
static-cache decoding recompiles per batch size, minutes per size).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import time

import torch

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

SHAPES = {
    # Llama-3.1-8B's config.json, minus the weights.
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
}


def random_model(shape: str, dtype: torch.dtype, device: str, folder: str):
    """transformers' Llama of that shape with random weights, built on the device and saved for our loader."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters created in the target dtype: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the bandwidth a decode step can use."""
    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n * 10 / (time.perf_counter() - t0)


def decode_step_seconds(engine: LLMEngine, prompt: list[int], new_tokens: int) -> float:
    """Median time of one sequence's decode steps (each step returns after its token is read back)."""
    engine.add_request("decode-timing", prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    decode = sorted(times[1:])  # the first step is the prefill
    return decode[len(decode) // 2]


def bench_ours(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(batch, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up, same sizes
    engine.reset_prefix_cache()  # random prompts share nothing; the warm-up's blocks must not count
    t0 = time.perf_counter()
    outs = engine.generate(batch, params)
    return sum(len(o) for o in outs) / (time.perf_counter() - t0)


def bench_transformers_ids(model, batch: list[list[int]], new_tokens: int) -> float:
    """transformers' generate on equal-length prompts (static KV cache on CUDA, eager), EOS never ends it."""
    device = next(model.parameters()).device
    ids = torch.tensor(batch, device=device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    if device.type == "cuda":
        kw |= dict(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up, same batch
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(device)
        elapsed = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * len(batch) / elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)"


def profile_decode(engine: LLMEngine, batch: list[list[int]], out_dir: str, device: torch.device,
                   steps: int = 8) -> dict:
    """torch.profiler over `steps` decode steps of this batch: the top kernels table goes to a file, and
    the return value says how much of a step's wall time the GPU was busy (the rest is host work)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"profile-{i}", p, params)
    while engine.scheduler.num_waiting or any(s.num_output_tokens < 2 for s in engine.scheduler.running):
        engine.step()  # prefill and the first decode steps, outside the profile
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = (time.perf_counter() - t0) / steps
    while engine.has_work():
        engine.step()
    events = prof.key_averages()
    with open(os.path.join(out_dir, f"profile_decode_b{len(batch)}.txt"), "w") as f:
        if device.type == "cuda":  # the GPU's kernels, then the host's own work (what keeps the GPU waiting)
            f.write(events.table(sort_by="cuda_time_total", row_limit=25) + "\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    if len(batch) == 1 and device.type == "cuda":  # the timeline: where the GPU waits on the host
        trace = os.path.join(out_dir, "trace_decode_b1.json")
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(trace)
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")  # 0 on CPU
    return {"profile_batch": len(batch), "step_wall_ms": round(wall * 1e3, 3),
            "gpu_kernel_ms_per_step": round(kernel_us / steps / 1e3, 3)}


def bench_shape(args) -> None:
    """A model of a given shape with random weights: ours (per attention backend, one after the other)
    against transformers' generate, same run."""
    dtype = getattr(torch, args.dtypes.split(",")[0])
    batches = [int(b) for b in args.batches.split(",")]
    print(f"engine bench: a {args.shape}-shaped model with RANDOM weights (no download); outputs are meaningless "
          "tokens, timings are real", file=sys.stderr)
    block_size = args.block_size or (64 if args.device == "cuda" else 16)
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        hf = random_model(args.shape, dtype, args.device, folder)
        print(f"random model built and saved in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        weight_bytes = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "embed_tokens" not in n)
        if args.skip_transformers:
            del hf
            hf = None
        refs: dict[int, list[float]] = {}
        variants = [(b, int(n)) for b in args.attention_backends.split(",") for n in args.graph_pieces.split(",")]
        for backend, pieces in variants:
            t0 = time.perf_counter()
            engine = LLMEngine(EngineConfig(
                model=ModelConfig(model=folder, dtype=args.dtypes.split(",")[0],
                                  max_model_len=args.prompt_tokens + args.new_tokens + block_size),
                cache=CacheConfig(block_size=block_size, kv_cache_bytes=1 << 30,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  enable_prefix_caching=not args.no_prefix_cache),
                scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches))),
                parallel=ParallelConfig(device=args.device, cpu=CpuConfig(threads_per_rank=args.threads),
                                        attention_backend=backend, cuda_graph_pieces=pieces)))
            print(f"our engine ({backend}, {pieces} graph pieces) loaded in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
            try:
                _bench_engine(args, engine, hf, refs, batches, dtype, block_size, weight_bytes)
            finally:
                engine.shutdown()


def _bench_engine(args, engine: LLMEngine, hf, refs: dict[int, list[float]], batches: list[int], dtype: torch.dtype,
                  block_size: int, weight_bytes: int) -> None:
    """One engine's lines; transformers runs once per batch size (the first engine's pass)."""
    worker = getattr(engine.executor, "worker", None)
    runner = getattr(worker, "runner", None)
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    backend = getattr(getattr(worker, "attn_backend", None), "name", None)
    common = {"bench": "engine", "shape": args.shape, "random_weights": True, "device": device_name(args.device),
              "dtype": str(dtype).removeprefix("torch."), "new_tokens": args.new_tokens,
              "prompt_tokens": args.prompt_tokens, "block_size": block_size, "attention_backend": backend,
              "cuda_graphs": getattr(runner, "graphs", None) is not None,
              "cuda_graph_pieces": engine.config.parallel.cuda_graph_pieces}
    batch: list[list[int]] = []
    for b in batches:
        batch = torch.randint(0, vocab, (b, args.prompt_tokens), generator=gen).tolist()
        ours_runs, ref_runs = [], refs.setdefault(b, [])
        fresh = not ref_runs
        for _ in range(args.rounds):
            ours_runs.append(bench_ours(engine, batch, args.new_tokens))
            if hf is not None and fresh:
                ref_runs.append(bench_transformers_ids(hf, batch, args.new_tokens))
        ours, ref = max(ours_runs), max(ref_runs, default=None)
        print(json.dumps(common | {
            "batch": b, "ours_tok_s": round(ours, 1), "transformers_tok_s": round(ref, 1) if ref else None,
            "ratio": round(ours / ref, 2) if ref else None,
            "ours_runs": [round(x, 1) for x in ours_runs], "transformers_runs": [round(x, 1) for x in ref_runs],
        }), flush=True)
    if args.profile:
        out_dir = os.path.join(args.profile, f"{backend}-{engine.config.parallel.cuda_graph_pieces}")
        os.makedirs(out_dir, exist_ok=True)
        for b in sorted({1, min(64, max(batches))}):
            rows = torch.randint(0, vocab, (b, args.prompt_tokens), generator=gen).tolist()
            print(json.dumps(common | profile_decode(engine, rows, out_dir, torch.device(args.device))), flush=True)
    if args.device == "cuda":
        step = decode_step_seconds(engine, batch[0], args.new_tokens)
        bandwidth = copy_bandwidth(args.device)
        roofline = weight_bytes / bandwidth
        print(json.dumps(common | {
            "batch": 1, "decode_step_ms": round(step * 1e3, 3), "weight_bytes": weight_bytes,
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "roofline_step_ms": round(roofline * 1e3, 3),
            "fraction_of_roofline": round(roofline / step, 3),
        }), flush=True)
