"""The engine alone, offline, with the engine settings a served config gives it: the ceiling that
serve_bench.py compares the served tok/s against, measured in the same run while no server runs.

    python benchmarks/serve_engine.py [--config cluster.yaml] [--batch 16[,64,...]] [--new-tokens 64] [--rounds 3]
        [--variant short|long|mixed]   # serve_bench.py's prompts of that variant (default: engine_bench's chat prompts)

Prints one JSON line per setting: `served` (the config's engine settings as they are: its torch
threads, prefix cache, weights), `whole_steps` (the same with `parallel.cpu.half_step_tokens: 0`, when the
config sets it: every step on the one thread) and `all_cores` (`parallel.cpu.threads_per_rank: 0`, as
engine_bench.py runs by default); on a GPU `served` and, where the config enables LoRA slots, `lora_off`
(`lora.max_loras: 0`: the engine that the served numbers are held against). Each line also has the engine's
step times from one more pass through its step loop: `first_step_ms` (the batch's prefill) and `step_ms_p50`
(the median step, a decode step of the whole batch). serve_bench.py runs this in a child process, before it
starts any server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)


def engine_config(config_path: str):
    """The first application's first model's engine config from a Serve config file, model path and device resolved."""
    import torch
    import yaml

    from rayllm.loader.model_files import resolve_model_path
    from rayllm.serve.builder import resolve_device
    from rayllm.serve.config import ServerConfig

    with open(config_path) as f:
        args = yaml.safe_load(f)["applications"][0].get("args") or {}
    server = ServerConfig.from_args(args)
    engine = server.models[0].engine if server.models else server.engine
    device = resolve_device(engine.parallel.device, {"GPU": float(torch.cuda.device_count())})
    return dataclasses.replace(
        engine, model=dataclasses.replace(engine.model, model=resolve_model_path(engine.model.model)),
        parallel=dataclasses.replace(engine.parallel, device=device))


def step_times(engine, batch: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Milliseconds of the batch's first step (its prefill, where the step budget holds it) and of the median
    step, through the engine's own step loop."""
    import time

    from rayllm.schema.sampling_params import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(f"steps-{i}", prompt, params)
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[0], sorted(times)[len(times) // 2]


def closed_loop(engine, prompts: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    """serve_bench.py's point, offline: `concurrency` slots take `prompts` in order, each the next prompt in the
    step after its request finished, as the bench's closed-loop streams do. Its output tok/s is the served
    numbers' like-for-like reference: the same arrivals, so the same mix of new prompts' prefill and the
    others' decodes in the steps (the batch figure has one prefill, then only decodes). Also the mean step."""
    import time

    from rayllm.schema.sampling_params import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    queue, running, tokens, steps = list(prompts), set(), 0, 0
    t0 = time.perf_counter()
    while queue or running:
        while queue and len(running) < concurrency:
            rid = f"closed-{len(prompts) - len(queue)}"
            engine.add_request(rid, queue.pop(0), params)
            running.add(rid)
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                running.discard(out.request_id)
        steps += 1
    wall = time.perf_counter() - t0
    return {"closed_tok_s": round(tokens / wall, 1), "closed_requests": len(prompts), "closed_tokens": tokens,
            "closed_step_ms_mean": round(wall / max(steps, 1) * 1e3, 3)}


def closed_loop_requests(variant: str | None, concurrency: int) -> int:
    """serve_bench.py's request count per point (its default): the streams' second and later requests arrive
    while the first ones decode."""
    return max(4 * concurrency, 24) if variant in (None, "short") else max(2 * concurrency, 8)


def variant_prompts(tokenizer, variant: str, n: int) -> list[list[int]]:
    from serve_prompts import messages_for

    return [tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False).input_ids for m in messages_for(variant, n, salt=n)]


def measure(config_path: str, batch: int | list[int], new_tokens: int, rounds: int,
            variant: str | None = None, only: list[str] | None = None, closed: bool = False) -> list[dict]:
    from engine_bench import bench_ours, prompts
    from transformers import AutoTokenizer

    from rayllm.engine.engine import LLMEngine

    base = engine_config(config_path)
    path = base.model.model
    if path.endswith(".gguf"):
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    batches = [batch] if isinstance(batch, int) else batch
    settings = {"served": base}
    if base.parallel.device == "cpu":  # the CPU-only variants (parallel.cpu is ignored on a GPU)
        if base.parallel.cpu.half_step_tokens:  # the served settings with every step whole on one thread
            settings["whole_steps"] = dataclasses.replace(base, parallel=dataclasses.replace(
                base.parallel, cpu=dataclasses.replace(base.parallel.cpu, half_step_tokens=0)))
        settings["all_cores"] = dataclasses.replace(base, parallel=dataclasses.replace(
            base.parallel, cpu=dataclasses.replace(base.parallel.cpu, threads_per_rank=0)))
    if base.lora.max_loras and (base.parallel.device != "cpu" or "lora_off" in (only or ())):
        # GPU: the served config as it ships, and the engine without adapter slots
        settings["lora_off"] = dataclasses.replace(base, lora=dataclasses.replace(base.lora, max_loras=0))
    if only:  # these settings, in this order
        settings = {name: settings[name] for name in only}
    lines = []
    for name, config in settings.items():
        engine = LLMEngine(config)  # one engine serves every batch size (an 8B model loads once)
        try:
            for size in batches:
                batch_prompts = variant_prompts(tokenizer, variant, size) if variant else prompts(tokenizer, size)
                runs = sorted(bench_ours(engine, batch_prompts, new_tokens) for _ in range(rounds))
                first_ms, step_ms = step_times(engine, batch_prompts, new_tokens)
                loop = {}
                if closed:  # n prompts salted by n, not the batch's: new requests to the prefix cache
                    n = closed_loop_requests(variant, size)
                    loop = closed_loop(engine, variant_prompts(tokenizer, variant, n) if variant
                                       else prompts(tokenizer, n), size, new_tokens)
                lines.append({"bench": "serve_engine", "setting": name, "config": os.path.relpath(config_path, REPO),
                              "batch": size, "new_tokens": new_tokens, "rounds": rounds, "variant": variant,
                              "prompt_tokens_mean": round(sum(map(len, batch_prompts)) / size, 1),
                              "threads": config.parallel.cpu.threads_per_rank,
                              "half_step_tokens": config.parallel.cpu.half_step_tokens,
                              "device": config.parallel.device, "dtype": config.model.dtype,
                              "max_loras": config.lora.max_loras,
                              "engine_tok_s": round(runs[len(runs) // 2], 1),  # the median round
                              "engine_runs": [round(x, 1) for x in runs],
                              "first_step_ms": round(first_ms, 3), "step_ms_p50": round(step_ms, 3), **loop})
                print(json.dumps(lines[-1]), flush=True)
        finally:
            engine.shutdown()
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "cluster.yaml"))
    ap.add_argument("--batch", default="16", help="batch sizes, comma-separated (each on the same engine)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", default=None, help="serve_bench.py's prompts of this variant (short, long, mixed)")
    ap.add_argument("--settings", default="", help="only these settings, in this order (e.g. lora_off,served)")
    ap.add_argument("--closed-loop", action="store_true",
                    help="also serve_bench.py's closed-loop arrivals at each batch size (closed_tok_s)")
    args = ap.parse_args(argv)
    measure(args.config, [int(b) for b in args.batch.split(",") if b.strip()], args.new_tokens, args.rounds,
            args.variant, [x for x in args.settings.split(",") if x.strip()], args.closed_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
