"""The engine alone, offline, with the engine settings a served config gives it: the ceiling that
serve_bench.py compares the served tok/s against, measured in the same run while no server runs.

    python benchmarks/serve_engine.py [--config cluster.yaml] [--batch 16[,64,...]] [--new-tokens 64] [--rounds 3]

Prints one JSON line per setting: `served` (the config's engine settings as they are: its torch
threads, prefix cache, weights), `whole_steps` (the same with `parallel.cpu.half_step_tokens: 0`, when the
config sets it: every step on the one thread) and `all_cores` (`parallel.cpu.threads_per_rank: 0`, as
engine_bench.py runs by default); on a GPU only `served` (the others change CPU-only settings). serve_bench.py
runs this in a child process, before it starts any server.
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


def measure(config_path: str, batch: int | list[int], new_tokens: int, rounds: int) -> list[dict]:
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
    lines = []
    for name, config in settings.items():
        engine = LLMEngine(config)  # one engine serves every batch size (an 8B model loads once)
        try:
            for size in batches:
                batch_prompts = prompts(tokenizer, size)
                runs = sorted(bench_ours(engine, batch_prompts, new_tokens) for _ in range(rounds))
                lines.append({"bench": "serve_engine", "setting": name, "config": os.path.relpath(config_path, REPO),
                              "batch": size, "new_tokens": new_tokens, "rounds": rounds,
                              "threads": config.parallel.cpu.threads_per_rank,
                              "half_step_tokens": config.parallel.cpu.half_step_tokens,
                              "device": config.parallel.device, "dtype": config.model.dtype,
                              "engine_tok_s": round(runs[len(runs) // 2], 1),  # the median round
                              "engine_runs": [round(x, 1) for x in runs]})
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
    args = ap.parse_args(argv)
    measure(args.config, [int(b) for b in args.batch.split(",") if b.strip()], args.new_tokens, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
