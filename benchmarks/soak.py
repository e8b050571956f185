"""Soak: rounds of streaming chat requests with a third abandoned mid-stream; does anything leak?

    python benchmarks/soak.py --url http://127.0.0.1:8000 [--api-key KEY] [--rounds 5]
    python benchmarks/soak.py --start [--rounds 2 --streams 64 --concurrency 16]   # a local Serve app

Per round: `--streams` streaming /v1/chat/completions at `--concurrency`, every third one closed by the
client after its first few chunks. Then it waits for the engine to go idle and prints one JSON line:
the engine process's RSS before and after the round (read from /proc: the server must run on this
machine, with its engine in its own process, as cluster.yaml sets it), and the KV-cache usage and
running/waiting counts once idle (from /metrics), which must return to 0, and the RSS change over the
round (`engine_rss_delta_mb`, the largest engine process). A last line gives the verdict: the RSS growth
over the last `--tail` rounds, `"flat": true` when it is at most `--flat-mb`. The first rounds grow while
oneDNN's per-shape caches fill (bounded by the engine process; docs/benchmarks.md): read the tail. Not a
test: numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from itertools import pairwise

import httpx

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
           "List ten fruits and one fact about each.", "Describe the water cycle to a child."]


def engine_pids() -> list[int]:
    """Engine child processes on this machine (`python -m rayllm.engine.client.engine_process FD`)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"rayllm.engine.client.engine_process" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return sorted(pids)


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gauges(base: str, headers: dict) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", headers=headers, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name.split(":")[1]] = float(line.rsplit(" ", 1)[1])
    return out


async def one(http: httpx.AsyncClient, base: str, model: str, i: int, max_tokens: int, abandon_after: int | None) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i}
    chunks = 0
    try:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if abandon_after is not None and chunks >= abandon_after:
                        return "abandoned"  # leaving the block closes the connection mid-stream
                    if '"error"' in line:
                        return "stream_error"
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return "completed"


async def round_(base: str, headers: dict, model: str, streams: int, concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def task(i: int) -> str:
            async with sem:
                return await one(http, base, model, i, max_tokens, 3 if i % 3 == 0 else None)

        results = await asyncio.gather(*(task(i) for i in range(streams)))
    counts: dict[str, int] = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    return counts


def wait_idle(base: str, headers: dict, timeout_s: float = 120) -> tuple[dict[str, float], float]:
    t0 = time.monotonic()
    while True:
        g = gauges(base, headers)
        if not g.get("num_requests_running") and not g.get("num_requests_waiting") or \
                time.monotonic() - t0 > timeout_s:
            return g, time.monotonic() - t0
        time.sleep(0.5)


def start_local() -> str:
    """A Serve app from cluster.yaml's args on a free port (this process keeps it alive)."""
    import ray
    import yaml
    from ray import serve

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rayllm.serve.builder import build_app

    with open(os.path.join(os.path.dirname(__file__), "..", "cluster.yaml")) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="llm", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the local app did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: --start)")
    ap.add_argument("--start", action="store_true", help="start a local Serve app from cluster.yaml")
    ap.add_argument("--api-key", default=os.environ.get("API_KEY"))
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tail", type=int, default=10, help="the verdict's rounds: the last N")
    ap.add_argument("--flat-mb", type=float, default=20, help="flat: at most this growth over the tail")
    a = ap.parse_args()
    base = start_local() if a.start or not a.url else a.url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    pids = engine_pids()
    series: list[float] = []  # the largest engine process's RSS after each round (before the first, first)
    for r in range(a.rounds):
        before = {p: rss_mb(p) for p in pids}
        t0 = time.monotonic()
        counts = asyncio.run(round_(base, headers, a.model, a.streams, a.concurrency, a.max_tokens))
        seconds = time.monotonic() - t0
        idle, waited = wait_idle(base, headers)
        after = {p: rss_mb(p) for p in pids}
        if not series:
            series.append(max((v or 0) for v in before.values()) if before else 0)
        series.append(max((v or 0) for v in after.values()) if after else 0)
        print(json.dumps({"round": r, "streams": a.streams, "concurrency": a.concurrency, "outcomes": counts,
                          "round_s": round(seconds, 1), "idle_after_s": round(waited, 1),
                          "engine_rss_mb_before": {str(p): v and round(v, 1) for p, v in before.items()},
                          "engine_rss_mb_after": {str(p): v and round(v, 1) for p, v in after.items()},
                          "engine_rss_delta_mb": round(series[-1] - series[-2], 1),
                          "idle_running": idle.get("num_requests_running"),
                          "idle_waiting": idle.get("num_requests_waiting"),
                          "idle_kv_usage": idle.get("kv_cache_usage_perc")}), flush=True)
    tail = min(a.tail, len(series) - 1)
    growth = series[-1] - series[-1 - tail] if tail else 0.0
    print(json.dumps({"verdict": "flat" if growth <= a.flat_mb else "growing", "flat": growth <= a.flat_mb,
                      "tail_rounds": tail, "tail_growth_mb": round(growth, 1), "flat_mb": a.flat_mb,
                      "rss_first_mb": round(series[0], 1), "rss_last_mb": round(series[-1], 1),
                      "per_round_mb": [round(y - x, 1) for x, y in pairwise(series)]}), flush=True)


if __name__ == "__main__":
    main()
