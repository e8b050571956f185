"""Cost of grammar-constrained decoding: a batch with JSON-schema requests beside the same batch free.

    python benchmarks/guided_bench.py [--batch 16] [--constrained 0,4,16] [--new-tokens 48] [--rounds 3]

Same engine, same prompts, same process: for each count of constrained requests in the batch, prints one
JSON line with tokens/s, the ratio to the unconstrained batch, and the per-request grammar compile time
(first compile and cached). Every request generates exactly --new-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.loader.model_files import default_model_path  # noqa: E402
from rayllm.sample.guided import GrammarCompiler  # noqa: E402
from rayllm.schema.config import EngineConfig  # noqa: E402
from rayllm.schema.sampling_params import GuidedSpec, SamplingParams  # noqa: E402
from rayllm.serve.tokenizer import TokenizerService  # noqa: E402

# A long required string keeps every constrained request generating until max_tokens, so constrained and
# free requests produce the same number of tokens and the ratio is the grammar's cost alone.
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"], "additionalProperties": False}


def run_batch(engine: LLMEngine, prompts: list[list[int]], grammars: list, new_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, (p, g) in enumerate(zip(prompts, grammars, strict=True)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params, grammar=g)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--constrained", default="0,4,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(default_model_path())
    tok = TokenizerService(path)
    engine = LLMEngine(EngineConfig.from_dict({"cache": {"kv_cache_bytes": 512 << 20}}), tok.eos_token_ids)
    compiler = GrammarCompiler(tok.transformers_tokenizer(), engine.arch.vocab_size, tok.eos_token_ids)
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    grammar = compiler.compile(spec)
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiler.compile(spec)
    cached_us = (time.perf_counter() - t0) * 1e6
    prompts = [tok.render_chat([{"role": "user", "content": f"Tell story number {i} as JSON."}])[1]
               for i in range(args.batch)]
    run_batch(engine, prompts[:2], [None, None], 4)  # warm-up
    base = None
    for k in (int(x) for x in args.constrained.split(",")):
        grammars = [grammar] * k + [None] * (args.batch - k)
        best = 0.0
        for _ in range(args.rounds):
            tokens, secs = run_batch(engine, prompts, grammars, args.new_tokens)
            best = max(best, tokens / secs)
        base = best if k == 0 else base
        print(json.dumps({"bench": "guided", "batch": args.batch, "constrained": k, "tok_s": round(best, 1),
                          "vs_free": round(best / base, 3) if base else None,
                          "compile_first_ms": round(first_ms, 2), "compile_cached_us": round(cached_us, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
