"""serve_bench.py's report (benchmarks/serve_report.py): served against the engine, the table's extra lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve_report import markdown, served_vs_engine  # noqa: E402

ENGINE = [
    {"bench": "serve_engine", "setting": "served", "batch": 16, "new_tokens": 64, "threads": 1,
     "engine_tok_s": 400.0, "engine_runs": [380.0, 400.0, 410.0]},
    {"bench": "serve_engine", "setting": "all_cores", "batch": 16, "new_tokens": 64, "threads": 0,
     "engine_tok_s": 500.0, "engine_runs": [500.0]},
]


def row(server: str, concurrency: int, tok_s: float, **extra) -> dict:
    return {"server": server, "variant": "short", "concurrency": concurrency, "output_tokens_per_s": tok_s, **extra}


def test_served_over_engine_at_the_engines_batch():
    rows = [row("ours", 1, 70.0), row("ours", 16, 320.0), row("peer", 16, 600.0)]
    [line] = served_vs_engine(rows, ENGINE, "ours", 0.75)
    assert line["served_tok_s"] == 320.0 and line["engine_tok_s"] == 400.0
    assert line["ratio"] == 0.8 and line["target_met"] is True
    assert line["ratio_all_cores"] == 0.64
    [low] = served_vs_engine([row("ours", 16, 200.0)], ENGINE, "ours", 0.75)
    assert low["ratio"] == 0.5 and low["target_met"] is False


def test_no_ratio_without_the_point_or_the_engine():
    assert served_vs_engine([row("ours", 4, 100.0)], ENGINE, "ours", 0.75) == []
    assert served_vs_engine([row("ours", 16, 100.0)], [], "ours", 0.75) == []


def test_table_shows_the_mid_stream_scenario_and_the_engine_lines():
    rows = [row("ours", 16, 300.0, variant="mid_long", long_prompt_mid_stream=False, itl_p99_ms=120.0),
            row("ours", 16, 250.0, variant="mid_long", long_prompt_mid_stream=True, itl_p99_ms=900.0,
                long_ttft_p50_s=1.5)]
    engine = ENGINE + served_vs_engine([row("ours", 16, 300.0)], ENGINE, "ours", 0.75)
    text = markdown(rows, engine)
    header = text.splitlines()[0]
    assert "ITL p99 ms" in header and "long prompt mid-stream" in header and "long prompt TTFT p50 s" in header
    assert "| ours | mid_long | 16 | False |" in text and "| ours | mid_long | 16 | True |" in text
    assert "400.0 tok/s" in text and "**75%** of the engine with the served settings (target 75%: met)" in text
