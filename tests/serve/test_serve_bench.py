"""benchmarks/serve_bench.py against the real test server: a small sweep, its JSON lines, table and plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_sweep_of_a_running_server_writes_lines_table_and_plot(server, tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import serve_bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    # What is checked is the sweep's bookkeeping (lines, table, plot), not its numbers: 16 tokens a request,
    # not the benchmark's 64, still stream several tokens each (ttft < wall) on the machine's pace.
    monkeypatch.setitem(serve_bench.MAX_TOKENS, "short", 16)
    rc = serve_bench.main(["--url", f"ours={server}", "--api-key", API_KEY, "--variants", "short",
                           "--concurrency", "1,2", "--requests", "2", "--wait-idle", "0",
                           "--results-dir", str(tmp_path)])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "serve-latest.jsonl").read_text().splitlines()]
    assert [(x["server"], x["variant"], x["concurrency"]) for x in lines] == [("ours", "short", 1), ("ours", "short", 2)]
    for x in lines:
        assert x["errors"] == 0 and x["completed"] == 2 and not x["timed_out"], x
        assert x["tokens_from"] == "usage" and 2 <= x["completion_tokens"] <= 2 * x["max_tokens"]
        assert x["output_tokens_per_s"] > 0 and 0 < x["ttft_p50_s"] <= x["ttft_p95_s"] < x["wall_s"]
        assert x["prompt_tokens_mean"] > 10  # chat-templated prompts, counted by the server
    table = (tmp_path / "serve-latest.md").read_text()
    assert "| ours | short | 1 | 2 | 0 |" in table and "| ours | short | 2 | 2 | 0 |" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "serve-short-latest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mid_stream_long_prompt_scenario(server, tmp_path):
    """mid_long: the streams' ITL with and without a ~1,000-token prompt sent once they all stream."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import serve_bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    rc = serve_bench.main(["--url", f"ours={server}", "--api-key", API_KEY, "--variants", "mid_long",
                           "--concurrency", "2", "--midstream-rounds", "1", "--wait-idle", "0",
                           "--results-dir", str(tmp_path)])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "serve-latest.jsonl").read_text().splitlines()]
    assert [(x["variant"], x["concurrency"], x["long_prompt_mid_stream"]) for x in lines] == [
        ("mid_long", 2, False), ("mid_long", 2, True)]
    for x in lines:
        assert x["errors"] == 0 and x["completed"] == 2, x
        assert 0 <= x["itl_p50_ms"] <= x["itl_p95_ms"] <= x["itl_p99_ms"]
    alone, with_long = lines
    assert "long_requests" not in alone
    assert with_long["long_requests"] == 1 and with_long["long_errors"] == 0
    assert 900 <= with_long["long_prompt_tokens_mean"] <= 1100 and with_long["long_ttft_p50_s"] > 0
    assert not list(tmp_path.glob("serve-mid_long-*.png"))  # two scenarios per point: no curve to plot
