"""The serving benchmark's statistics (benchmarks/serve_stats.py): percentiles, token spreading, summaries."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve_stats import Result, percentile, spread_tokens, summarize  # noqa: E402


@pytest.mark.parametrize("q", [0, 10, 50, 95, 100])
def test_percentile_matches_numpy_linear(q):
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.35]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], q) is None


def test_spread_tokens_shares_a_burst_by_text_length_and_keeps_the_total():
    assert spread_tokens([5, 5, 5], 3) == [1, 1, 1]
    spread = spread_tokens([10, 30, 0, 20], 12)
    assert sum(spread) == 12 and min(spread) >= 1 and spread[1] > spread[3] > spread[0]


def test_summary_counts_only_completed_requests():
    ok = [Result(ok=True, ttft=0.1 * (i + 1), itl=[0.01, 0.03], tpot=0.02, completion_tokens=10, prompt_tokens=20)
          for i in range(3)]
    bad = Result(ok=False, error="HTTP 500")
    s = summarize(ok + [bad], n_requested=4, wall=2.0, timed_out=False)
    assert (s["completed"], s["errors"], s["completion_tokens"]) == (3, 1, 30)
    assert s["output_tokens_per_s"] == 15.0 and s["requests_per_s"] == 1.5
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["tpot_p50_ms"] == pytest.approx(20.0)
    assert s["itl_p50_ms"] == pytest.approx(20.0) and s["tokens_from"] == "usage"
    assert s["prompt_tokens_mean"] == 20.0 and s["error_samples"] == ["HTTP 500"]
