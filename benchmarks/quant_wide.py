"""A tiny-but-wide random Llama GGUF (Q4_0 linear weights) through the engine in each weight mode.

    python benchmarks/quant_wide.py [--hidden 2048] [--intermediate 8192] [--layers 4] [--batches 1,16,64]
                                    [--variants default,batch_invariant,quantized] [--new-tokens 32]

The weights are random (gguf's own Q4_0 quantizer over normal noise), written with the gguf package's
writer; prompts are random token ids. One JSON line per (variant, batch): tokens/s (best of
`--rounds`, variants alternating) and the process's resident-memory growth when the engine loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_bench import _rss_mb, bench_ours, weight_mb  # noqa: E402

from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.schema.config import (  # noqa: E402
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def write_gguf(path: str, hidden: int, inter: int, layers: int, vocab: int, qtype: str = "Q4_0") -> None:
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    heads, kv_heads = hidden // 128, max(1, hidden // 512)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    t = gguf.GGMLQuantizationType[qtype]

    def q(name: str, n: int, k: int) -> None:
        data = quantize((rng.standard_normal((n, k)) * k**-0.5).astype(np.float32), t)
        w.add_tensor(name, data, raw_dtype=t)

    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    q("output.weight", vocab, hidden)
    kv = kv_heads * 128
    for i in range(layers):
        for name, n, k in [("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                           ("attn_output", hidden, hidden), ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden),
                           ("ffn_down", hidden, inter)]:
            q(f"blk.{i}.{name}.weight", n, k)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--variants", default="default,batch_invariant,quantized")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "wide.gguf")
        write_gguf(path, args.hidden, args.intermediate, args.layers, args.vocab)
        engines, rss = {}, {}
        for variant in args.variants.split(","):
            before = _rss_mb()
            engines[variant] = LLMEngine(EngineConfig(
                model=ModelConfig(model=path, weights="quantized" if variant == "quantized" else "auto"),
                cache=CacheConfig(kv_cache_bytes=256 << 20),
                scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048,
                                          batch_invariant=variant == "batch_invariant"),
                parallel=ParallelConfig(cpu=CpuConfig(threads_per_rank=args.threads)),
            ))
            rss[variant] = round(_rss_mb() - before)
        rng = np.random.default_rng(1)
        for b in batches:
            batch = [rng.integers(0, args.vocab, 24 + i % 16).tolist() for i in range(b)]
            runs: dict[str, list[float]] = {v: [] for v in engines}
            for _ in range(args.rounds):
                for variant, engine in engines.items():
                    runs[variant].append(bench_ours(engine, batch, args.new_tokens))
            for variant in engines:
                print(json.dumps({"bench": "quant_wide", "hidden": args.hidden, "intermediate": args.intermediate,
                                  "layers": args.layers, "batch": b, "variant": variant, "rss_load_mb": rss[variant],
                                  "weight_mb": round(weight_mb(engines[variant])),
                                  "tok_s": round(max(runs[variant]), 1), "runs": [round(x, 1) for x in runs[variant]]}),
                      flush=True)
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
