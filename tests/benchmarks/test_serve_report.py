"""serve_bench.py's report (benchmarks/serve_report.py): served against the engine, the table's extra lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serve_report import markdown, median_rounds, served_engine_table, served_vs_engine  # noqa: E402

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


def test_median_round_per_server_and_point():
    # Three rounds of two servers at one point, plus a mid-stream pair: each server keeps its median
    # round whole (its TTFT with its tok/s), every round's tok/s is carried, ratios are dropped.
    rows = [row("ours", 16, tok, round=i, ttft_p50_s=ttft, ratio_tokens_per_s=9.9, vs={"peer": {}})
            for i, (tok, ttft) in enumerate([(300.0, 0.2), (340.0, 0.1), (320.0, 0.3)])]
    rows += [row("peer", 16, tok, round=i) for i, tok in enumerate([250.0, 200.0, 260.0])]
    rows += [row("ours", 16, 280.0, variant="mid_long", long_prompt_mid_stream=flag, round=0) for flag in (False, True)]
    short, mid_plain, mid_long = median_rounds(rows)
    ours, peer = short
    assert (ours["output_tokens_per_s"], ours["ttft_p50_s"]) == (320.0, 0.3)
    assert ours["round_tokens_per_s"] == [300.0, 340.0, 320.0] and ours["rounds"] == 3
    assert "round" not in ours and "vs" not in ours and "ratio_tokens_per_s" not in ours
    assert peer["output_tokens_per_s"] == 250.0
    assert [p[0]["long_prompt_mid_stream"] for p in (mid_plain, mid_long)] == [False, True]


def test_the_gpu_runs_served_against_engine_table():
    """tests/gpu/serve_device.sh's table: the lora_off engine is the reference, the served engine's step comes
    from the watcher's lines at a running count near the stream count."""
    engine = [{"bench": "serve_engine", "setting": "served", "batch": 16, "engine_tok_s": 1000.0, "step_ms_p50": 9.0},
              {"bench": "serve_engine", "setting": "lora_off", "batch": 16, "engine_tok_s": 2000.0,
               "first_step_ms": 40.0, "step_ms_p50": 6.0, "closed_tok_s": 1600.0, "closed_step_ms_mean": 8.5},
              {"bench": "serve_engine", "setting": "lora_off", "batch": 1, "engine_tok_s": 200.0,
               "first_step_ms": 12.5, "step_ms_p50": 4.8}]
    bench = [row("ours", 1, 180.0, bench="serve", tpot_p50_ms=5.28, ttft_p50_s=0.031),
             row("ours", 16, 1500.0, bench="serve", tpot_p50_ms=7.2, ttft_p50_s=0.2)]
    stats = [{"running": 16, "step_ms_mean": 6.6, "busy": 0.9}, {"running": 12, "step_ms_mean": 7.0, "busy": 1.0},
             {"running": 3, "step_ms_mean": 5.0, "busy": 0.5}, {"running": 1, "step_ms_mean": 4.9, "busy": 0.8}]
    lines = served_engine_table(engine, bench, stats).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| streams |")
    one, sixteen = (line.split(" | ") for line in lines[2:])
    assert one[1:5] == ["180.0", "200.0", "0.900", "5.28"] and one[5:7] == ["4.80", "1.10"]
    assert one[7:9] == ["4.90", "0.80"] and one[9] == "31.0 (prefill 12.5 + 20)" and one[10:] == ["-", "-", "- |"]
    assert sixteen[1:4] == ["1500.0", "2000.0", "0.750"] and sixteen[6] == "1.20"
    assert sixteen[7:9] == ["6.80", "0.95"]  # medians of the lines with 8 < running <= 16
    assert sixteen[10:] == ["1600.0", "0.938", "8.50 |"]  # against the engine under the bench's own arrivals
