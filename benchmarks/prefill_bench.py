"""Prefill attention alone: triton_prefill.py's paged kernel against torch's own causal SDPA (flash on
CUDA) over the same keys in contiguous memory, same run, Llama-3.1-8B's attention shape (32 query heads,
8 KV heads, head dim 128, bf16, blocks of 64 scattered over the cache).

    python benchmarks/prefill_bench.py [--lengths 8000,32000] [--chunk 8192] [--configs 128x64x8x3,128x128x8x3]

Per length: the whole prompt in one call, and (--chunk) in the engine's chunks, each after the cached
prefix. TFLOP/s counts the causal half of QK^T and PV: 2 * 2 * L^2 / 2 * D * Hq. One JSON line each, with
the device, commit and settings.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_bench_workloads import commit  # noqa: E402

from rayllm.attention.triton import StepArgs  # noqa: E402
from rayllm.attention.triton_prefill import PrefillConfig, default_config, prefill_attention  # noqa: E402


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def timed(fn, device: torch.device, reps: int) -> float:
    fn()  # compile / warm up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def case(length: int, hq: int, hk: int, d: int, bs: int, dtype: torch.dtype, device: torch.device):
    """A cache holding one sequence of `length` keys in scattered blocks, its queries, and the same keys
    contiguous for SDPA."""
    gen = torch.Generator(device=device).manual_seed(0)
    nb = -(-length // bs)
    k_cache = torch.randn(hk, nb + 1, bs, d, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn(hk, nb + 1, bs, d, device=device, dtype=dtype, generator=gen)
    table = torch.randperm(nb + 1, device=device, generator=gen)[:nb].int().view(1, nb)
    q = torch.randn(length, hq, d, device=device, dtype=dtype, generator=gen)
    keys = k_cache[:, table[0].long()].reshape(hk, nb * bs, d)[:, :length]
    values = v_cache[:, table[0].long()].reshape(hk, nb * bs, d)[:, :length]
    return q, k_cache, v_cache, table, keys.unsqueeze(0).contiguous(), values.unsqueeze(0).contiguous()


def chunk_steps(length: int, chunk: int, table: torch.Tensor, device: torch.device) -> list[tuple[StepArgs, int]]:
    """The engine's chunks of one prompt: chunk i's rows start at 0 of its own q (as the runner lays a
    step out) and see the i * chunk keys before it."""
    i32 = dict(dtype=torch.int32, device=device)
    steps = []
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        steps.append((StepArgs(table, torch.tensor([start + n], **i32), torch.tensor([0], **i32),
                               torch.tensor([n], **i32), None), start))
    return steps


def run_chunks(q, k_cache, v_cache, out, table, length: int, chunk: int, cfg: PrefillConfig) -> None:
    for step, start in chunk_steps(length, chunk, table, q.device):
        n = min(chunk, length - start)
        prefill_attention(q[start : start + n], k_cache, v_cache, out[start : start + n], step, n, config=cfg)


def parse_config(text: str) -> PrefillConfig:
    m, n, w, s = (int(x) for x in text.split("x"))
    return PrefillConfig(m, n, w, s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8000,32000")
    ap.add_argument("--chunk", type=int, default=8192, help="also time the prompt in chunks of this many (0: no)")
    ap.add_argument("--configs", default="", help="tile configs MxNxWARPSxSTAGES to compare (default: the shipped one)")
    ap.add_argument("--heads", default="32,8", help="query heads, KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="also compare the output with SDPA's")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hk = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    common = {"bench": "prefill_attention", "device": device_name(device), "commit": commit(), "dtype": str(dtype),
              "heads": [hq, hk], "head_dim": d, "block_size": args.block_size, "torch": torch.__version__}
    for length in (int(x) for x in args.lengths.split(",")):
        q, k_cache, v_cache, table, keys, values = case(length, hq, hk, d, args.block_size, dtype, device)
        flops = 2 * 2 * length * length / 2 * d * hq
        qs = q.transpose(0, 1).unsqueeze(0)
        sdpa_s = timed(partial(F.scaled_dot_product_attention, qs, keys, values, is_causal=True, enable_gqa=True),
                       device, args.reps)
        print(json.dumps(common | {"kernel": "torch_sdpa_contiguous", "length": length, "ms": round(sdpa_s * 1e3, 3),
                                   "tflops": round(flops / sdpa_s / 1e12, 1)}), flush=True)
        configs = [parse_config(c) for c in args.configs.split(",") if c] or [default_config(d, dtype, length)]
        for cfg in configs:
            out = torch.empty_like(q)
            s = timed(partial(run_chunks, q, k_cache, v_cache, out, table, length, length, cfg), device, args.reps)
            line = {"kernel": "triton_prefill_paged", "length": length, "config": cfg.__dict__,
                    "ms": round(s * 1e3, 3), "tflops": round(flops / s / 1e12, 1), "vs_sdpa": round(sdpa_s / s, 3)}
            if args.check:
                want = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
                line["max_abs_err"] = float((out.transpose(0, 1).unsqueeze(0).float() - want.float()).abs().max())
            print(json.dumps(common | line), flush=True)
            if args.chunk and args.chunk < length:
                s = timed(partial(run_chunks, q, k_cache, v_cache, out, table, length, args.chunk, cfg), device,
                          args.reps)
                print(json.dumps(common | {"kernel": "triton_prefill_paged_chunked", "chunk": args.chunk,
                                           "length": length, "config": cfg.__dict__, "ms": round(s * 1e3, 3),
                                           "tflops": round(flops / s / 1e12, 1), "vs_sdpa": round(sdpa_s / s, 3)}),
                      flush=True)

if __name__ == "__main__":
    main()
