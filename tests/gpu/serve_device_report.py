"""The served-against-engine table of a device run (tests/gpu/serve_device.sh), from its logs: per stream count,
served output tok/s against the engine alone's (`lora_off`: the config without adapter slots) at the same batch
(target >= 0.9), served time per output token p50 against the engine's median step (target <= 1.1x), and at one
stream the time to first token against the engine's prefill step + 20 ms. With engine_stats.log (the served
engine's own counters, polled during the bench) it adds the served engine's mean step at that load and the
share of wall time it was inside a step.

    python tests/gpu/serve_device_report.py ENGINE_LOG SERVE_BENCH_LOG [ENGINE_STATS_LOG]
"""

from __future__ import annotations

import json
import statistics
import sys


def lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.startswith("{")]
    except FileNotFoundError:
        return []


def report(engine_log: str, bench_log: str, stats_log: str | None = None) -> str:
    engine = {x["batch"]: x for x in lines(engine_log) if x.get("setting") == "lora_off"}
    served = {x["concurrency"]: x for x in lines(bench_log) if x.get("bench") == "serve"}
    stats = lines(stats_log) if stats_log else []
    rows = ["| streams | served tok/s | engine tok/s (LoRA off) | served / engine (>= 0.9) | served TPOT p50 ms | "
            "engine step p50 ms | TPOT / step (<= 1.1) | served engine step ms | served engine busy | TTFT p50 ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(served):
        s, e = served[c], engine.get(c, {})
        ratio = s["output_tokens_per_s"] / e["engine_tok_s"] if e.get("engine_tok_s") else None
        tpot = s.get("tpot_p50_ms")
        per_step = tpot / e["step_ms_p50"] if tpot and e.get("step_ms_p50") else None
        load = [x for x in stats if (x["running"] == 1 if c == 1 else c / 2 < x["running"] <= c)]
        step = statistics.median(x["step_ms_mean"] for x in load) if load else None
        busy = statistics.median(x["busy"] for x in load) if load else None
        ttft = s["ttft_p50_s"] * 1e3 if s.get("ttft_p50_s") is not None else None
        ttft_note = f" (prefill {e['first_step_ms']:.1f} + 20)" if c == 1 and e.get("first_step_ms") else ""

        def f(v, fmt="{:.1f}"):
            return fmt.format(v) if v is not None else "-"
        rows.append(f"| {c} | {f(s['output_tokens_per_s'])} | {f(e.get('engine_tok_s'))} | {f(ratio, '{:.3f}')} | "
                    f"{f(tpot, '{:.2f}')} | {f(e.get('step_ms_p50'), '{:.2f}')} | {f(per_step, '{:.2f}')} | "
                    f"{f(step, '{:.2f}')} | {f(busy, '{:.2f}')} | {f(ttft)}{ttft_note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(report(*sys.argv[1:4]))
