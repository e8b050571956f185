"""Bounded streaming load generator for OpenAI-compatible servers, swept over concurrency.

    python benchmarks/serve_bench.py --url llamacpp=http://127.0.0.1:8001
    python benchmarks/serve_bench.py --start-ours --start-llamacpp [--transformers-floor] [--quick]

Every request is a streaming /v1/chat/completions (temperature 0, include_usage). Per sweep point
(server, variant, concurrency) it prints one JSON line on stdout; servers are swept alternately point
by point. The Markdown table and PNG plots go to benchmarks/results/ (timestamped + "latest" copies).
Traffic goes to the given URLs only (127.0.0.1 for the servers this script starts); every request
loop is bounded by a request count and a per-point time cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_peers  # noqa: E402
import serve_report  # noqa: E402
from serve_prompts import messages_for  # noqa: E402

MAX_TOKENS = {"short": 64, "long": 32}


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    end: float = 0.0


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


async def one_request(client: httpx.AsyncClient, base: str, model: str, messages: list[dict],
                      max_tokens: int) -> Result:
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0.0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    res = Result()
    times: list[float] = []
    chars: list[int] = []
    usage = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:200]}"
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        times.append(now)
                        chars.append(len(text))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.end = time.perf_counter()
    if usage is None:
        res.error = "no usage chunk (stream_options.include_usage ignored?)"
        return res
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    if times:
        res.ttft = times[0] - t0
        per_chunk = spread_tokens(chars, res.completion_tokens)
        for i in range(1, len(times)):
            gap, k = times[i] - times[i - 1], per_chunk[i]
            res.itl.extend([gap / k] * k)
    res.ok = True
    return res


def summarize(results: list[Result], n_requested: int, wall: float, timed_out: bool) -> dict:
    ok = [r for r in results if r.ok]
    toks = sum(r.completion_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl]
    errors = [r.error for r in results if not r.ok]

    def rnd(x, k=4):
        return None if x is None else round(x, k)

    return {
        "requests": n_requested, "completed": len(ok), "errors": n_requested - len(ok),
        "timed_out": timed_out, "wall_s": rnd(wall, 3),
        "ttft_p50_s": rnd(percentile(ttft, 50)), "ttft_p95_s": rnd(percentile(ttft, 95)),
        "itl_p50_ms": rnd(None if not itl else 1000 * percentile(itl, 50), 2),
        "itl_p95_ms": rnd(None if not itl else 1000 * percentile(itl, 95), 2),
        "output_tokens_per_s": rnd(toks / wall if wall > 0 else None, 2),
        "requests_per_s": rnd(len(ok) / wall if wall > 0 else None, 3),
        "completion_tokens": toks,
        "prompt_tokens_mean": rnd(sum(r.prompt_tokens for r in ok) / len(ok), 1) if ok else None,
        "error_samples": sorted(set(e for e in errors if e))[:3],
    }


async def run_point(client: httpx.AsyncClient, base: str, model: str, prompts: list[list[dict]],
                    concurrency: int, max_tokens: int, cap_s: float, bar: tqdm) -> dict:
    """`concurrency` closed-loop workers share the fixed prompt list; nothing starts after the cap."""
    queue = list(enumerate(prompts))
    results: list[Result] = []
    t0 = time.perf_counter()
    deadline = t0 + cap_s

    async def worker() -> None:
        while queue and time.perf_counter() < deadline:
            _, msgs = queue.pop(0)
            try:
                r = await asyncio.wait_for(one_request(client, base, model, msgs, max_tokens),
                                           max(0.1, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                r = Result(error=f"per-point cap of {cap_s:.0f}s reached", end=time.perf_counter())
            results.append(r)
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    bar.update(len(queue))  # never started: the cap was reached
    ends = [r.end for r in results if r.end]
    wall = (max(ends) if ends else time.perf_counter()) - t0
    out = summarize(results, len(prompts), wall, timed_out=bool(queue) or time.perf_counter() > deadline)
    return out


async def served_model(client: httpx.AsyncClient, base: str) -> str:
    resp = await client.get(f"{base}/v1/models", timeout=30)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def add_ratios(lines: list[dict], ours: str) -> None:
    """ratio_* = ours / peer at the same point, on ours' line (first peer) and under "vs" (all peers)."""
    mine = next((x for x in lines if x["server"] == ours), None)
    if mine is None:
        return
    vs = {}
    for peer in lines:
        if peer is mine:
            continue
        a, b = mine.get("output_tokens_per_s"), peer.get("output_tokens_per_s")
        c, d = mine.get("ttft_p50_s"), peer.get("ttft_p50_s")
        vs[peer["server"]] = {"ratio_tokens_per_s": round(a / b, 3) if a and b else None,
                              "ratio_ttft_p50": round(c / d, 3) if c and d else None}
    if vs:
        first = next(iter(vs))
        mine.update({"peer": first, **vs[first], "vs": vs})


async def sweep(args, servers: dict[str, str], floor) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.point_timeout + 30, connect=10)
    rows: list[dict] = []
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        models = {name: await served_model(client, url) for name, url in servers.items()}
        for name, url in servers.items():  # warm-up, not measured
            r = await one_request(client, url, models[name], [{"role": "user", "content": "Hi!"}], 8)
            if not r.ok:
                raise SystemExit(f"warm-up request to {name} ({url}) failed: {r.error}")
        for variant in args.variants:
            total = sum(args.n_requests(c) for c in args.concurrency) * (len(servers) + bool(floor))
            bar = tqdm(total=total, desc=f"{variant} sweep", unit="req", file=sys.stderr, dynamic_ncols=True)
            for c in args.concurrency:
                prompts = messages_for(variant, args.n_requests(c), salt=c)
                point = []
                for name, url in servers.items():
                    bar.set_postfix_str(f"{name} c={c}")
                    stats = await run_point(client, url, models[name], prompts, c, MAX_TOKENS[variant],
                                            args.point_timeout, bar)
                    point.append({"bench": "serve", "server": name, "variant": variant, "concurrency": c,
                                  "model": models[name], "max_tokens": MAX_TOKENS[variant], **stats})
                if floor is not None:
                    bar.set_postfix_str(f"transformers c={c}")
                    stats = await asyncio.to_thread(floor.run_point, prompts, c, MAX_TOKENS[variant],
                                                    args.point_timeout)
                    bar.update(len(prompts))
                    point.append({"bench": "serve", "server": "transformers", "variant": variant,
                                  "concurrency": c, "model": floor.name, "max_tokens": MAX_TOKENS[variant],
                                  **stats})
                add_ratios(point, args.ours)
                for line in point:
                    tqdm.write(json.dumps(line), file=sys.stdout)
                    sys.stdout.flush()
                rows.extend(point)
            bar.close()
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                    help="an already-running OpenAI-compatible server (repeatable), e.g. llamacpp=http://127.0.0.1:8001")
    ap.add_argument("--start-ours", action="store_true", help="start `serve run cluster.yaml` (port 8000)")
    ap.add_argument("--start-llamacpp", action="store_true",
                    help="build/reuse benchmarks/.venv-llamacpp and start llama-cpp-python's server (port 8001)")
    ap.add_argument("--transformers-floor", action="store_true",
                    help="also time transformers' static-batch generate (batch = concurrency)")
    ap.add_argument("--floor-dtype", default="bfloat16", help="dtype for the transformers floor")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=0, help="requests per point (default max(2*c, 8))")
    ap.add_argument("--variants", default="short,long", help="short (max_tokens 64), long (~1k-token prompts, 32)")
    ap.add_argument("--point-timeout", type=float, default=300.0, help="time cap per sweep point, seconds")
    ap.add_argument("--ours", default="ours", help="which server the ratio_* fields put first")
    ap.add_argument("--api-key", default=os.environ.get("BENCH_API_KEY"), help="Bearer key (or BENCH_API_KEY)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for a started server")
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4 and 4 requests per point")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency = "1,4"
        args.requests = args.requests or 4
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in MAX_TOKENS]
    if bad or not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"bad --variants {bad} or --concurrency {args.concurrency}")
    fixed = args.requests
    args.n_requests = (lambda c: fixed) if fixed > 0 else (lambda c: max(2 * c, 8))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servers: dict[str, str] = {}
    started: list[serve_peers.Started] = []
    floor = None
    try:
        if args.start_llamacpp:
            started.append(serve_peers.start_llamacpp(args.start_timeout))
        if args.start_ours:
            started.append(serve_peers.start_ours(args.start_timeout))
        servers.update({s.name: s.url for s in started})
        for spec in args.url:
            name, sep, url = spec.partition("=")
            if not sep or not url.startswith("http"):
                raise SystemExit(f"--url wants NAME=URL, got {spec!r}")
            servers[name] = url.rstrip("/")
        if args.ours in servers:  # ours first at every point
            servers = {args.ours: servers[args.ours], **servers}
        if args.transformers_floor:
            floor = serve_peers.TransformersFloor(args.floor_dtype)
        if not servers and floor is None:
            raise SystemExit("nothing to benchmark: give --url NAME=URL, --start-ours or --start-llamacpp")
        print(f"servers: {servers}" + (" + transformers floor" if floor else ""), file=sys.stderr)
        rows = asyncio.run(sweep(args, servers, floor))
        paths = serve_report.write(rows, args.results_dir)
        print(serve_report.markdown(rows), file=sys.stderr)
        print("wrote " + ", ".join(paths), file=sys.stderr)
    finally:
        for s in reversed(started):
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
