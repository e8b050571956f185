"""Markdown table, JSON lines and PNG plots for serve_bench.py results."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

COLUMNS = [
    ("server", "server"), ("variant", "variant"), ("concurrency", "conc."), ("completed", "ok"),
    ("errors", "errors"), ("output_tokens_per_s", "out tok/s"), ("requests_per_s", "req/s"),
    ("ttft_p50_s", "TTFT p50 s"), ("ttft_p95_s", "TTFT p95 s"), ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p95_ms", "ITL p95 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
]
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


def markdown(rows: list[dict]) -> str:
    cols = columns(rows)
    out = ["| " + " | ".join(t for _, t in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_cell(_value(r, k)) for k, _ in cols) + " |")
    return "\n".join(out)


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


def write(rows: list[dict], results_dir: str) -> list[str]:
    """serve-<ts>.{jsonl,md} and serve-<variant>-<ts>.png, each copied to a *-latest name."""
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
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def md(path):
        with open(path, "w") as f:
            f.write(markdown(rows) + "\n")

    emit("serve", "jsonl", jsonl)
    emit("serve", "md", md)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the numbers are written; only the pictures need it
        print("matplotlib is not installed: no plots (.venv/bin/pip install matplotlib)", file=sys.stderr)
        return written
    for variant in dict.fromkeys(r["variant"] for r in rows):
        emit(f"serve-{variant}", "png", lambda p, v=variant: plot(rows, v, p))
    return written
