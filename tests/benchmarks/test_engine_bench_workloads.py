"""benchmarks/engine_bench.py's issue-33 workloads (--workload mixed, --long-prompts) on CPU at small sizes,
on the bench's own `tiny` shape with RANDOM weights (built by transformers in the bench): the CLI runs end to
end, the seeded draws are what the lines report, EOS is ignored (every request yields exactly its drawn
output length), and the FLOP count matches transformers' own parameter count of the same model."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)

import engine_bench  # noqa: E402
from engine_bench_shape import SHAPES  # noqa: E402
from engine_bench_workloads import mixed_requests, model_flops, peak_flops  # noqa: E402

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def test_mixed_draws_are_seeded_and_within_bounds() -> None:
    a = mixed_requests(512, (128, 1024), (64, 256), 1000, seed=0)
    assert a == mixed_requests(512, (128, 1024), (64, 256), 1000, seed=0)
    assert a != mixed_requests(512, (128, 1024), (64, 256), 1000, seed=1)
    lens, outs = [len(p) for p, _ in a], [o for _, o in a]
    assert 128 <= min(lens) < 160 and 990 < max(lens) <= 1024  # uniform over the whole inclusive range
    assert 64 <= min(outs) < 70 and 250 < max(outs) <= 256
    assert all(0 <= t < 1000 for p, _ in a for t in p)


def test_flops_count_transformers_parameters() -> None:
    """One token in, one out: 2 FLOPs per weight of the layers and the LM head (transformers' parameter
    count, norms aside), plus attention to the one key: 4 x head dim x heads x layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES["tiny"]
    model = LlamaForCausalLM(LlamaConfig(**shape))
    weights = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n and "embed_tokens" not in n)
    attention = 4 * shape["head_dim"] * shape["num_attention_heads"] * shape["num_hidden_layers"]
    assert model_flops(shape, 1, 1) == 2 * weights + attention
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12 and peak_flops("cpu (2 cores)") is None


def test_cli_mixed_and_long_prompts(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [
        "engine_bench.py", "--shape", "tiny", "--dtypes", "float32", "--workload", "mixed", "--requests", "6",
        "--prompt-range", "5,40", "--output-range", "3,9", "--seed", "3", "--long-prompts", "50,130",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "48", "--threads", "1", "--rounds", "1"])
    torch.manual_seed(0)
    engine_bench.main()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    settings, mixed, *longs = lines
    assert settings["settings"]["max_num_batched_tokens"] == 48 and settings["commit"] and settings["device"]
    drawn = mixed_requests(6, (5, 40), (3, 9), SHAPES["tiny"]["vocab_size"], 3)
    assert mixed["output_tokens"] == sum(o for _, o in drawn)
    assert mixed["prompt_tokens"] == sum(len(p) for p, _ in drawn)
    # tokens / seconds, as far as the line's rounding allows (seconds to 1 ms, tok/s to 0.1): a fast run of
    # ~36 ms is 1.4 % off at most from the rounding of its seconds alone.
    tokens, s = mixed["prompt_tokens"] + mixed["output_tokens"], mixed["seconds"]
    assert tokens / (s + 5e-4) - 0.05 <= mixed["total_tok_s"] <= tokens / max(s - 5e-4, 1e-9) + 0.05
    assert [x["prompt_tokens"] for x in longs] == [50, 130] and all(x["ttft_s"] > 0 for x in longs)
    assert all(x["commit"] == settings["commit"] and x["fraction_of_limit"] is None for x in lines[1:])  # CPU: no peak
