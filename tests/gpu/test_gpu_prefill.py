"""The Triton prefill kernel on CUDA at Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head
dim 128, bf16, blocks of 64): an 8,000-token prompt whole and in the engine's 4,096-token chunks after
their cached prefix, against torch's causal SDPA over the same keys (random inputs). The small cases of
tests/attention/test_triton_prefill.py (windows, soft-capping, odd lengths, bf16) run natively on CUDA from
that file. The speed is printed (JSON, -s), never asserted: benchmarks/prefill_bench.py measures it."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))


def test_8k_prompt_whole_and_chunked_matches_sdpa() -> None:
    from prefill_bench import case, chunk_steps

    from rayllm.attention.triton_prefill import prefill_attention

    device, length, chunk = torch.device("cuda"), 8000, 4096
    q, k_cache, v_cache, table, keys, values = case(length, 32, 8, 128, 64, torch.bfloat16, device)
    want = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, is_causal=True,
                                          enable_gqa=True)[0].transpose(0, 1).float()
    out = torch.empty_like(q)
    step, _ = chunk_steps(length, length, table, device)[0]
    prefill_attention(q, k_cache, v_cache, out, step, length)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prefill_attention(q, k_cache, v_cache, out, step, length)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    chunked = torch.empty_like(q)
    for step, start in chunk_steps(length, chunk, table, device):
        n = min(chunk, length - start)
        prefill_attention(q[start : start + n], k_cache, v_cache, chunked[start : start + n], step, n)
    torch.testing.assert_close(chunked.float(), want, atol=2e-2, rtol=2e-2)
    flops = 2 * 2 * length * length / 2 * 128 * 32
    print(json.dumps({"prefill_8k_ms": round(seconds * 1e3, 3), "tflops": round(flops / seconds / 1e12, 1),
                      "device": torch.cuda.get_device_name()}))
