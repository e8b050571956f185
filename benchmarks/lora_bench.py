"""Multi-LoRA throughput: a 32-request batch spread over 0, 1, 4 and 8 distinct adapters, beside the base model.

    python benchmarks/lora_bench.py [--requests 32] [--new-tokens 64] [--rank 16] [--adapters 0,1,4,8] [--rounds 2]
                                    [--targets q_proj,v_proj] [--threads 1] [--batch-invariant]

Adapters are random PEFT files (every q/k/v/o/gate/up/down projection, rank --rank) written to a temp dir.
"base" is an engine with LoRA disabled; the other points share one engine with lora.max_loras=8, where
"0 adapters" measures the cost of merely having LoRA enabled. --batch-invariant runs both engines with
scheduler.batch_invariant (per-adapter oneDNN GEMMs instead of the padded bmm). Points are interleaved over --rounds and
each keeps its best round (the machine is shared). One JSON line per point, with its ratio to base.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.engine_bench import prompts  # noqa: E402
from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.loader.loader import read_arch  # noqa: E402
from rayllm.loader.model_files import default_model_path  # noqa: E402
from rayllm.lora.files import random_peft_adapter  # noqa: E402
from rayllm.schema.config import (  # noqa: E402
    CacheConfig,
    CpuConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams  # noqa: E402


def run(engine: LLMEngine, batch: list[list[int]], lora_ids: list[int], new_tokens: int) -> float:
    """Tokens/s for the whole batch, request i on adapter lora_ids[i] (0 = base)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = time.monotonic_ns()
    t0 = time.perf_counter()
    for i, (p, lora) in enumerate(zip(batch, lora_ids, strict=True)):
        engine.add_request(f"b{tag}-{i}", p, params, lora_slot=lora)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="0,1,4,8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (cluster.yaml's parallel.cpu.threads_per_rank)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-invariant", action="store_true", help="scheduler.batch_invariant on both engines")
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    help="modules the random adapters train (PEFT's default for Llama is q_proj,v_proj)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    batch = prompts(tokenizer, args.requests)
    counts = [int(c) for c in args.adapters.split(",")]

    def config(lora: LoRAConfig) -> EngineConfig:
        # No prefix caching: every round must compute its prompts again.
        return EngineConfig(model=ModelConfig(model=path, dtype=args.dtype),
                            parallel=ParallelConfig(cpu=CpuConfig(threads_per_rank=args.threads)),
                            cache=CacheConfig(kv_cache_bytes=1 << 30, enable_prefix_caching=False),
                            scheduler=SchedulerConfig(max_num_seqs=args.requests, max_num_batched_tokens=2048,
                                                      batch_invariant=args.batch_invariant),
                            lora=lora)

    base = LLMEngine(config(LoRAConfig()))
    multi = LLMEngine(config(LoRAConfig(max_loras=max(counts), max_lora_rank=args.rank)))
    arch = read_arch(path)
    with tempfile.TemporaryDirectory() as tmp:
        for slot in range(1, max(counts) + 1):
            adapter = random_peft_adapter(os.path.join(tmp, f"a{slot}"), arch, rank=args.rank, seed=slot,
                                          targets=tuple(args.targets.split(",")))
            multi.executor.load_lora(slot, slot, adapter)  # adapter id = slot here
    for engine in (base, multi):
        run(engine, batch[:2], [0, 0], 4)  # warm-up
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        best["base"] = max(best.get("base", 0.0), run(base, batch, [0] * len(batch), args.new_tokens))
        for c in counts:
            ids = [(i % c) + 1 if c else 0 for i in range(len(batch))]  # round-robin over c adapters
            key = str(c)
            best[key] = max(best.get(key, 0.0), run(multi, batch, ids, args.new_tokens))
    for key, tok_s in best.items():
        print(json.dumps({
            "bench": "lora", "batch_invariant": args.batch_invariant, "dtype": args.dtype, "requests": args.requests, "new_tokens": args.new_tokens,
            "rank": args.rank, "targets": args.targets, "adapters": None if key == "base" else int(key), "tok_s": round(tok_s, 1),
            "vs_base": round(tok_s / best["base"], 3),
        }), flush=True)
    base.shutdown()
    multi.shutdown()


if __name__ == "__main__":
    main()
