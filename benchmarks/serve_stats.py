"""Per-request results and per-point statistics for serve_bench.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tpot: float | None = None  # (last content chunk - first) / (completion_tokens - 1): burst-proof
    completion_tokens: int = 0
    prompt_tokens: int = 0
    end: float = 0.0
    counted_chunks: bool = False  # no usage chunk came: completion_tokens = content chunks


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread_tokens(chars: list[int], total: int) -> list[int]:
    """Tokens per content chunk: 1 each, or `total` shared by text length when chunks carry several."""
    n = len(chars)
    if total <= n or n == 0:
        return [1] * n
    weights = [max(c, 1) for c in chars]
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [max(1, int(r)) for r in raw]
    # largest remainder, bounded by n steps either way
    for i in sorted(range(n), key=lambda i: raw[i] - int(raw[i]), reverse=True)[: max(0, total - sum(out))]:
        out[i] += 1
    return out


def summarize(results: list[Result], n_requested: int, wall: float, timed_out: bool) -> dict:
    ok = [r for r in results if r.ok]
    toks = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    errors = [r.error for r in results if not r.ok]

    def rnd(x, k=4):
        return None if x is None else round(x, k)

    return {
        "requests": n_requested, "completed": len(ok), "errors": n_requested - len(ok),
        "timed_out": timed_out, "wall_s": rnd(wall, 3),
        "ttft_p50_s": rnd(percentile(ttft, 50)), "ttft_p95_s": rnd(percentile(ttft, 95)),
        "itl_p50_ms": rnd(None if not itl else 1000 * percentile(itl, 50), 2),
        "itl_p95_ms": rnd(None if not itl else 1000 * percentile(itl, 95), 2),
        "itl_p99_ms": rnd(None if not itl else 1000 * percentile(itl, 99), 2),
        "tpot_p50_ms": rnd(None if not tpot else 1000 * percentile(tpot, 50), 2),
        "tpot_p95_ms": rnd(None if not tpot else 1000 * percentile(tpot, 95), 2),
        "output_tokens_per_s": rnd(toks / wall if wall > 0 else None, 2),
        "requests_per_s": rnd(len(ok) / wall if wall > 0 else None, 3),
        "completion_tokens": toks,
        "tokens_from": ("content chunks (no usage)" if all(r.counted_chunks for r in ok) else
                        "usage" if not any(r.counted_chunks for r in ok) else "mixed") if ok else None,
        "prompt_tokens_mean": rnd(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok and ok[0].prompt_tokens else None,
        "error_samples": sorted(set(e for e in errors if e))[:3],
    }


def cpu_busy(interval: float = 1.0) -> float | None:
    """Share of all CPU time that was not idle over `interval` seconds (Linux /proc/stat; None elsewhere)."""
    import time

    def sample():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0)  # total, idle + iowait

    try:
        t1, i1 = sample()
        time.sleep(interval)
        t2, i2 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (i2 - i1) / max(1, t2 - t1), 3)
