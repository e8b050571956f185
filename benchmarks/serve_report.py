"""Markdown table, JSON lines and PNG plots for serve_bench.py results."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time

COLUMNS = [
    ("server", "server"), ("variant", "variant"), ("concurrency", "conc."),
    ("long_prompt_mid_stream", "long prompt mid-stream"), ("completed", "ok"), ("errors", "errors"), ("output_tokens_per_s", "out tok/s"), ("requests_per_s", "req/s"),
    ("ttft_p50_s", "TTFT p50 s"), ("ttft_p95_s", "TTFT p95 s"), ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p95_ms", "ITL p95 ms"), ("itl_p99_ms", "ITL p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
    ("long_ttft_p50_s", "long prompt TTFT p50 s"),
]
PLOTTED = ("short", "long")  # variants swept over concurrency (mid_long is two scenarios per point)
# ours / peer, on ours' line: for the first peer as top-level fields, for every peer under "vs"
RATIOS = [("ratio_tokens_per_s", "tok/s ratio"), ("ratio_ttft_p50", "TTFT ratio")]


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _value(row: dict, key: str | tuple[str, str]):
    """A plain field, or (peer, ratio field) from the row's `vs`."""
    if isinstance(key, tuple):
        return ((row.get("vs") or {}).get(key[0]) or {}).get(key[1])
    return row.get(key)


def columns(rows: list[dict]) -> list[tuple[str | tuple[str, str], str]]:
    """COLUMNS that hold a value, then the ratios: one pair per peer in `vs` (every peer, not only the first)."""
    peers = list(dict.fromkeys(p for r in rows for p in (r.get("vs") or {})))
    ratios = [((p, k), f"{t} vs {p}") for p in peers for k, t in RATIOS] if peers else RATIOS
    return [(k, t) for k, t in COLUMNS + ratios if any(_value(r, k) is not None for r in rows)]


def markdown(rows: list[dict], engine: list[dict] | None = None) -> str:
    cols = columns(rows)
    out = ["| " + " | ".join(t for _, t in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_cell(_value(r, k)) for k, _ in cols) + " |")
    return "\n".join(out + engine_lines(engine or []))


def median_rounds(rows: list[dict]) -> list[list[dict]]:
    """Rows of several rounds -> per point (variant, concurrency, mid-stream flag) the median round of each
    server by output tok/s, carrying every round's tok/s; the points in sweep order."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        key = (r["variant"], r["concurrency"], bool(r.get("long_prompt_mid_stream")))
        groups.setdefault(key, {}).setdefault(r["server"], []).append(r)
    points = []
    for servers in groups.values():
        point = []
        for runs in servers.values():
            ranked = sorted(runs, key=lambda r: r.get("output_tokens_per_s") or 0.0)
            mid = {k: v for k, v in ranked[(len(ranked) - 1) // 2].items()
                   if k not in ("round", "peer", "vs") and not k.startswith("ratio_")}
            point.append({**mid, "rounds": len(runs),
                          "round_tokens_per_s": [r.get("output_tokens_per_s") for r in runs]})
        points.append(point)
    return points


def served_vs_engine(rows: list[dict], engine: list[dict], ours: str, target: float) -> list[dict]:
    """Ours' short-prompt tok/s at the engine's batch over the engine's offline tok/s (both settings)."""
    by = {x["setting"]: x for x in engine if x.get("bench") == "serve_engine"}
    if "served" not in by:
        return []
    batch = by["served"]["batch"]
    row = next((r for r in rows if r["server"] == ours and r["variant"] == "short" and r["concurrency"] == batch), None)
    served = row and row.get("output_tokens_per_s")
    if not served:
        return []
    out = {"bench": "serve_vs_engine", "server": ours, "variant": "short", "concurrency": batch,
           "served_tok_s": served, "engine_tok_s": by["served"]["engine_tok_s"],
           "ratio": round(served / by["served"]["engine_tok_s"], 3), "target_ratio": target}
    out["target_met"] = out["ratio"] >= target
    if "all_cores" in by:
        out.update(engine_all_cores_tok_s=by["all_cores"]["engine_tok_s"],
                   ratio_all_cores=round(served / by["all_cores"]["engine_tok_s"], 3))
    return [out]


def served_engine_table(engine_lines: list[dict], bench_lines: list[dict], stats_lines: list[dict]) -> str:
    """The GPU device run's table (tests/gpu/serve_device.sh), per stream count: served output tok/s against the
    engine alone's without adapter slots (serve_engine.py `lora_off`) at that batch (target >= 0.9), served time
    per output token p50 against the engine's median step (<= 1.1x), the served engine's own mean step and
    busy share at that load (engine_stats_watch.py lines whose running count is near it), at one stream the
    time to first token against the engine's prefill step + 20 ms, and where serve_engine.py ran --closed-loop the
    served tok/s against the engine alone under the bench's own closed-loop arrivals."""
    engine = {x["batch"]: x for x in engine_lines if x.get("setting") == "lora_off"}
    served = {x["concurrency"]: x for x in bench_lines if x.get("bench") == "serve"}
    stats = stats_lines
    rows = ["| streams | served tok/s | engine tok/s (LoRA off) | served / engine (>= 0.9) | served TPOT p50 ms | "
            "engine step p50 ms | TPOT / step (<= 1.1) | served engine step ms | served engine busy | TTFT p50 ms | "
            "engine closed-loop tok/s | served / closed loop | closed-loop step ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(served):
        s, e = served[c], engine.get(c, {})
        ratio = s["output_tokens_per_s"] / e["engine_tok_s"] if e.get("engine_tok_s") else None
        # serve_engine.py --closed-loop: the engine alone under the bench's own arrivals (like for like)
        closed = s["output_tokens_per_s"] / e["closed_tok_s"] if e.get("closed_tok_s") else None
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
                    f"{f(step, '{:.2f}')} | {f(busy, '{:.2f}')} | {f(ttft)}{ttft_note} | {f(e.get('closed_tok_s'))} | "
                    f"{f(closed, '{:.3f}')} | {f(e.get('closed_step_ms_mean'), '{:.2f}')} |")
    return "\n".join(rows)


def engine_lines(engine: list[dict]) -> list[str]:
    """The same run's offline engine measurement and the served/engine ratio, as sentences."""
    out = []
    for e in engine:
        if e.get("bench") == "serve_engine":
            out.append(f"- engine alone, offline, batch {e['batch']}, {e['new_tokens']} new tokens, `{e['setting']}` "
                       f"settings (torch threads: {e['threads'] or 'all'}): {e['engine_tok_s']} tok/s "
                       f"(median of {e['engine_runs']})")
        elif e.get("bench") == "serve_vs_engine":
            all_cores = (f"; {e['ratio_all_cores']:.0%} of the engine on all cores" if "ratio_all_cores" in e else "")
            out.append(f"- served at {e['concurrency']} streams ({e['server']}, short): {e['served_tok_s']} tok/s = "
                       f"**{e['ratio']:.0%}** of the engine with the served settings (target "
                       f"{e['target_ratio']:.0%}: {'met' if e['target_met'] else 'not met'}){all_cores}")
    return [""] + out if out else []


def plot(rows: list[dict], variant: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["variant"] == variant]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["server"] for r in sel):
        pts = sorted((r["concurrency"], r.get("output_tokens_per_s"), r.get("ttft_p50_s"))
                     for r in sel if r["server"] == name)
        xs = [p[0] for p in pts]
        ax1.plot(xs, [p[1] for p in pts], marker="o", label=name)
        if any(p[2] is not None for p in pts):
            ax2.plot(xs, [p[2] for p in pts], marker="o", label=name)
    for ax, title, ylabel in ((ax1, "output tokens/s", "tokens/s"), (ax2, "TTFT p50", "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in sel}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} ({variant} prompts)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict], results_dir: str, engine: list[dict] | None = None) -> list[str]:
    """serve-<ts>.{jsonl,md} and serve-<variant>-<ts>.png, each copied to a *-latest name; `engine`
    (the same run's offline engine lines) follows the points in the JSON lines and the table."""
    os.makedirs(results_dir, exist_ok=True)
    ts = time.strftime("%Y%m%d-%H%M%S")
    written = []

    def emit(stem: str, ext: str, fill) -> None:
        path = os.path.join(results_dir, f"{stem}-{ts}.{ext}")
        fill(path)
        latest = os.path.join(results_dir, f"{stem}-latest.{ext}")
        shutil.copyfile(path, latest)
        written.extend([path, latest])

    def jsonl(path):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows + (engine or []))

    def md(path):
        with open(path, "w") as f:
            f.write(markdown(rows, engine) + "\n")

    emit("serve", "jsonl", jsonl)
    emit("serve", "md", md)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the numbers are written; only the pictures need it
        print("matplotlib is not installed: no plots (.venv/bin/pip install matplotlib)", file=sys.stderr)
        return written
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] in PLOTTED):
        emit(f"serve-{variant}", "png", lambda p, v=variant: plot(rows, v, p))
    return written
