"""Offline engine throughput beside transformers' static-batch generate, in the same run.

    python benchmarks/engine_bench.py [--batches 1,16,64] [--new-tokens 64] [--dtypes bfloat16,float32]
                                      [--rounds 2] [--threads 0] [--no-prefix-cache] [--device cpu|cuda]
                                      [--variants default,weight_only,batch_invariant,quantized] [--model PATH]
                                      [--shape llama-3.1-8b|tiny]
                                      [--tp 2 --cpu-allreduce gloo,shm]
                                      [--shape S --workload mixed] [--shape S --long-prompts 8000,32000]
                                      [[--shape S] --workload penalties --new-tokens 64 [--sampler-baseline 327cda2]]

`--shape` benchmarks a model of that shape with random weights instead of the default model (no
download; every output line says `random_weights`): prompts are random token ids, outputs ignore EOS.
On CUDA it also reports batch-1 decode step time against the HBM roofline (weight bytes / measured
device copy bandwidth), and transformers runs with its static cache.

Prints one JSON line per (dtype, batch) with our tokens/s, transformers' tokens/s and the ratio, and
the tokens/s that the bare matmuls alone would allow (`gemm_only_*`: the ceiling for any engine that
computes every prompt token; ours, with the prefix cache on, computes a shared prompt prefix once).
The two run alternately, `--rounds` times each, and each side reports its best round: this machine
is shared, and a single run of either varies by +-20 %. `--variants` runs several engine settings
side by side in the same run (rounds alternate between them too), each with its resident-memory
growth at load (`rss_load_mb`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_bench_shape import SHAPES, bench_shape  # noqa: E402

from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.loader.model_files import default_model_path  # noqa: E402
from rayllm.platforms.cpu import qgemm as cpu_qgemm  # noqa: E402
from rayllm.platforms.cpu.onednn import OneDNNWeight, onednn_available  # noqa: E402
from rayllm.schema.config import (  # noqa: E402
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
    "How many legs does a spider have?", "Translate 'good morning' into Spanish.", "What is 12 times 12?",
    "Name a famous physicist.", "Give me a tip for learning to code.", "Why is the sky blue?",
    "Describe a cat in one sentence.", "What is photosynthesis?", "Suggest a name for a bakery.",
    "How do airplanes fly?", "What is the boiling point of water?", "Tell me a fun fact about octopuses.",
    "Explain recursion simply.",
]


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def bench_ours(engine: LLMEngine, batch: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(batch[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    # Rounds repeat the same prompts: start each from an empty prefix cache, so only what the batch
    # itself shares (the chat template's system prompt) is reused, as for a burst of new requests.
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = engine.generate(batch, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o) for o in outs) / elapsed


def bench_transformers(model, tokenizer, batch: list[list[int]], new_tokens: int) -> float:
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in batch)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        _sync(device)
        elapsed = time.perf_counter() - t0
    return (out.shape[1] - width) * len(batch) / elapsed


def gemm_floor(model, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds for the matmuls alone that any engine must run for this batch: every prompt token
    through every projection, then `new_tokens - 1` decode steps of one row per sequence, plus the
    LM head for one row per sequence per step. Nothing else (no attention, norms or sampling), so
    `transformers' seconds / this` is the most any engine with these GEMMs can gain over it here.
    The weights are reordered for oneDNN as our engine's are (platforms/cpu/onednn.py): the fastest
    GEMM we know of in this dtype, so the ceiling holds for us too."""
    linears = [m.weight for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")]
    head = model.get_output_embeddings().weight
    dtype, b, prompt_tokens = head.dtype, len(batch), sum(len(p) for p in batch)

    def gemm(w: torch.Tensor):
        if onednn_available(w.device, w.dtype):
            return partial(OneDNNWeight(w), bias=None)
        return partial(F.linear, weight=w)

    layers = [(gemm(w), w.shape[1]) for w in linears]
    head_gemm = gemm(head)
    prefill = {k: torch.randn(prompt_tokens, k, dtype=dtype) for _, k in layers}
    decode = {k: torch.randn(b, k, dtype=dtype) for _, k in layers}
    rows = torch.randn(b, head.shape[1], dtype=dtype)
    with torch.no_grad():
        t0 = time.perf_counter()
        for fn, k in layers:
            fn(prefill[k])
        head_gemm(rows)
        for _ in range(new_tokens - 1):
            for fn, k in layers:
                fn(decode[k])
            head_gemm(rows)
        return time.perf_counter() - t0


def _rss_mb() -> float:
    """This process's resident memory now (Linux), in MB."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def weight_mb(engine: LLMEngine) -> float:
    """MB held by the model's weights in every form (parameters, oneDNN copies, quantized copies)."""
    model = engine.executor.worker.model
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = t.data_ptr() if t.layout == torch.strided else id(t)  # oneDNN's opaque tensors have no pointer
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
    for m in model.modules():  # each linear layer's weight method (rayllm/layers/linear_method.py)
        method = getattr(m, "method", None)
        for part in (method, getattr(method, "small", None), getattr(method, "large", None)):
            add(getattr(part, "weight", None))  # oneDNN's layout
            for attr in ("packed", "scales", "q", "scale", "zero"):
                add(getattr(part, attr, None))
    return total / 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--no-gemm-floor", action="store_true", help="skip timing the bare matmuls (the bf16 ceiling)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="turn prefix caching off (by default it is on, as served, and emptied before each round)")
    ap.add_argument("--threads", type=int, default=0, help="our engine's torch threads (0 = all cores, as "
                    "transformers uses); cluster.yaml serves with 1")
    ap.add_argument("--variants", default="default",
                    help="comma list of engine settings: default, weight_only (parallel.cpu.small_batch_quant), "
                    "batch_invariant, quantized (model.weights), int4_vnni_1pass (one int8 pass on every 4-bit layer; "
                    "the default, parallel.cpu.int8_passes, gives two), int4_vnni_gateup2 (two on gate/up only), "
                    "int4_vnni_head_i8 / int4_vnni_head_bf16 (the LM head on a per-channel int8 copy, the default before / its bf16 weights); "
                    "joined by +: halves (parallel.cpu.half_step_tokens 48), qgemm2 (parallel.cpu.qgemm_threads 2)")
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a model of this shape with random weights "
                    "(engine_bench_shape.py)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="--shape: random prompt length")
    ap.add_argument("--block-size", type=int, default=0, help="--shape: KV block size (0: 64 on CUDA, 16 on CPU)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                    help="--shape on CUDA: our engine's share; transformers' model and static cache need the rest")
    ap.add_argument("--attention-backends", default="auto",
                    help="--shape: our engine once per backend, in this order (e.g. triton,sdpa on CUDA)")
    ap.add_argument("--graph-pieces", default=str(ParallelConfig.cuda_graph_pieces),
                    help="--shape on CUDA: parallel.cuda_graph_pieces values to compare")
    ap.add_argument("--profile", default="", help="--shape: write torch.profiler tables of decode steps here")
    ap.add_argument("--tp", type=int, default=1, help="> 1: CPU tensor parallel, see engine_bench_tp.py")
    ap.add_argument("--cpu-allreduce", default="gloo,shm", help="--tp: the all-reduce backends to compare")
    ap.add_argument("--workload", choices=["mixed", "penalties"],
                    help="mixed (--shape): the mixed load (engine_bench_workloads.py); penalties: decode steps of "
                    "penalised requests with a long history (engine_bench_penalties.py)")
    ap.add_argument("--penalty-requests", type=int, default=16, help="--workload penalties: requests at once")
    ap.add_argument("--penalty-prompt-tokens", type=int, default=1500, help="--workload penalties: prompt length")
    ap.add_argument("--sampler-baseline", default="", help="--workload penalties: time the sampler alone against "
                    "rayllm/sample/sampling_inputs.py at this commit (e.g. 327cda2), no model")
    ap.add_argument("--sampler-vocabs", default="49152,128256", help="--sampler-baseline: vocabulary sizes")
    ap.add_argument("--long-prompts", default="", help="--shape: time to first token of one prompt of each length")
    ap.add_argument("--requests", type=int, default=512, help="--workload mixed: requests, submitted at once")
    ap.add_argument("--prompt-range", default="128,1024", help="--workload mixed: prompt lengths, uniform")
    ap.add_argument("--output-range", default="64,256", help="--workload mixed: output lengths, uniform")
    ap.add_argument("--seed", type=int, default=0, help="--workload / --long-prompts: the random draws' seed")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="--workload / --long-prompts")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="--workload / --long-prompts")
    args = ap.parse_args()
    if args.workload == "penalties":
        from engine_bench_penalties import bench_penalties, bench_sampler

        return bench_sampler(args) if args.sampler_baseline else bench_penalties(args)
    if args.shape and (args.workload or args.long_prompts):
        from engine_bench_workloads import bench_workloads

        return bench_workloads(args)
    if args.shape:
        return bench_shape(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.model or default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    if args.tp > 1:
        from engine_bench_tp import bench_tp

        return bench_tp(args, path, partial(prompts, tokenizer))
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(dt, b) for dt in args.dtypes.split(",") for b in batches]
    bar = tqdm(total=len(cases), desc="engine bench", file=sys.stderr)
    for dtype in args.dtypes.split(","):
        variants = args.variants.split(",")
        engines, rss = {}, {}
        for variant in variants:
            before = _rss_mb()
            engines[variant] = LLMEngine(
                EngineConfig(
                    model=ModelConfig(model=path, dtype=dtype, weights="quantized" if variant == "quantized" else "auto"),
                    cache=CacheConfig(kv_cache_bytes=1 << 30, enable_prefix_caching=not args.no_prefix_cache),
                    scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048,
                                              batch_invariant=variant == "batch_invariant"),
                    parallel=ParallelConfig(device=args.device, cpu=CpuConfig(
                        threads_per_rank=args.threads,
                        small_batch_quant="weight_only" if variant == "weight_only" else "auto",
                        half_step_tokens=48 if "halves" in variant.split("+") else 0,
                        qgemm_threads=2 if "qgemm2" in variant.split("+") else 0)),
                )
            )
            if variant.startswith("int4_vnni_"):  # other int8 passes per layer (quant_quality.py)
                from quant_quality import repack

                repack(engines[variant], variant)
            rss[variant] = round(_rss_mb() - before)
        hf = None
        if not args.skip_transformers:
            hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).to(args.device).eval()
        for b in batches:
            batch = prompts(tokenizer, b)
            ours_runs: dict[str, list[float]] = {v: [] for v in variants}
            ref_runs, floor_runs = [], []
            for _ in range(args.rounds):  # alternate, so drifting machine load hits both
                for variant, engine in engines.items():
                    if args.device == "cpu":  # the kernel pool's setting is per process: each engine's own
                        cpu_qgemm.POOL.threads = engine.config.parallel.cpu.qgemm_threads
                    ours_runs[variant].append(bench_ours(engine, batch, args.new_tokens))
                if hf is not None:
                    ref_runs.append(bench_transformers(hf, tokenizer, batch, args.new_tokens))
                    if not args.no_gemm_floor and args.device == "cpu":  # the oneDNN ceiling is a CPU figure
                        floor_runs.append(b * args.new_tokens / gemm_floor(hf, batch, args.new_tokens))
            ref = max(ref_runs, default=None)
            floor = max(floor_runs, default=None)
            for variant in variants:
                ours = max(ours_runs[variant])
                print(json.dumps({
                    "bench": "engine", "dtype": dtype, "batch": b, "new_tokens": args.new_tokens,
                    "variant": variant, "rss_load_mb": rss[variant], "weight_mb": round(weight_mb(engines[variant])),
                    "threads": torch.get_num_threads(), "rounds": args.rounds,
                    "prefix_cache": not args.no_prefix_cache,
                    "ours_tok_s": round(ours, 1), "transformers_tok_s": round(ref, 1) if ref else None,
                    "ratio": round(ours / ref, 2) if ref else None,
                    # Tokens/s if the bare matmuls were the whole cost, and that over transformers: the
                    # ceiling on `ratio` for any engine computing every prompt token in this dtype here.
                    "gemm_only_tok_s": round(floor, 1) if floor else None,
                    "gemm_only_ratio": round(floor / ref, 2) if floor and ref else None,
                    "ours_runs": [round(x, 1) for x in ours_runs[variant]],
                    "transformers_runs": [round(x, 1) for x in ref_runs],
                }), flush=True)
            bar.update()
        for engine in engines.values():
            engine.shutdown()
        del hf
    bar.close()


if __name__ == "__main__":
    main()
