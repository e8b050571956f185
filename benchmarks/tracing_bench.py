"""What OpenTelemetry tracing costs a served request (issue 38: off costs nothing measurable, on <= 3 %
throughput at 16 streams).

    python benchmarks/tracing_bench.py [--rounds 4] [--concurrency 16] [--requests 64] [--max-tokens 64]

One Ray Serve instance with two copies of cluster.yaml's application (its settings; a smaller KV cache each),
`off` (tracing.enabled false) and `on` (enabled, every request sampled, exported over OTLP/HTTP every 5 s to
a receiver in this process that only keeps the bodies; they are decoded and counted after the last round).
Rounds alternate the order of the two; the idle app costs nothing meanwhile. Each point is serve_bench's
closed loop of streaming chat requests (short prompts, temperature 0). Prints one JSON line per round and
variant, then a summary line: median tok/s of each, on/off, the spans received per request, and the cost of
the hooks that run per request while tracing is off (in-process, nanoseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
import timeit
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Sink(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that answers at once and keeps each body (decoded after the measurement)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler) -> None:  # noqa: N805
                self.bodies.append(handler.rfile.read(int(handler.headers["Content-Length"])))
                handler.send_response(200)
                handler.send_header("Content-Length", "0")
                handler.end_headers()

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def spans(self) -> list[dict]:
        """Every span received so far: name, trace id (hex), start and end (ns)."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        return [{"name": s.name, "trace": s.trace_id.hex(), "start": s.start_time_unix_nano, "end": s.end_time_unix_nano}
                for b in list(self.bodies) for rs in ExportTraceServiceRequest.FromString(b).resource_spans
                for ss in rs.scope_spans for s in ss.spans]

    def span_count(self) -> int:
        return len(self.spans())


def off_hooks_ns() -> float:
    """Nanoseconds per request of the tracing hooks on the ingress's and replica's paths while tracing is off."""
    from rayllm.protocol.io_struct import GenerateRequest, StopOptions
    from rayllm.schema.sampling_params import SamplingParams
    from rayllm.serve import tracing
    from rayllm.serve.tracing_spans import dispatch, model_trace, traced_storage

    tracing.shutdown()
    req = GenerateRequest("r", [[1]], SamplingParams(), StopOptions())

    async def write(state) -> None:
        return None

    def one() -> None:
        with tracing.span("validate"):
            pass
        with tracing.client_span("render"):
            pass
        dispatch(req, "m")
        traced_storage(write)
        tracing.current_span()
        with model_trace(req, "m"):
            pass

    n = 200_000
    hooks = min(timeit.repeat(one, number=n, repeat=3)) / n * 1e9
    return hooks + asyncio.run(middleware_ns())


async def middleware_ns(n: int = 200_000) -> float:
    """What the ASGI middleware adds to an HTTP request while tracing is off (passing it straight on)."""
    from rayllm.serve.tracing_spans import TracingMiddleware

    async def inner(scope, receive, send) -> None:
        return None

    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []}
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            await inner(scope, None, None)
        t1 = time.perf_counter()
        middleware = TracingMiddleware(inner)
        for _ in range(n):
            await middleware(scope, None, None)
        best = min(best, (time.perf_counter() - t1) - (t1 - t0))
    return max(best, 0.0) / n * 1e9


def deploy(base_args: dict, sink_port: int, port: int, order: list[str]) -> dict[str, str]:
    import httpx
    from ray import serve

    from rayllm.serve.builder import build_app

    urls = {}
    for name in order:  # deployed in this order (a check that the app deployed first has no edge)
        enabled = name == "on"
        args = json.loads(json.dumps(base_args))
        args["tracing"] = {"enabled": enabled, "otlp_endpoint": f"http://127.0.0.1:{sink_port}/v1/traces"}
        serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
        urls[name] = f"http://127.0.0.1:{port}/{name}"
    for url in urls.values():
        deadline = time.time() + 600
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            if time.time() > deadline:
                raise RuntimeError(f"{url} did not become healthy")
            time.sleep(0.5)
    return urls


async def measure(args, urls: dict[str, str]) -> list[dict]:
    import httpx
    from serve_client import one_request, run_point
    from serve_prompts import messages_for
    from serve_stats import cpu_busy
    from tqdm import tqdm

    model = "SmolLM2-135M-Instruct"
    rows = []
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for url in urls.values():  # warm: first requests pay one-time costs
            for _ in range(2):
                await one_request(client, url, model, messages_for("short", 1)[0], 8)
        for r in range(args.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                busy = cpu_busy()
                bar = tqdm(total=args.requests, desc=f"round {r} {name}", file=sys.stderr, leave=False)
                prompts = messages_for("short", args.requests)
                stats = await run_point(client, urls[name], model, prompts, args.concurrency, args.max_tokens,
                                        600.0, bar)
                bar.close()
                row = {"bench": "tracing", "variant": name, "round": r, "concurrency": args.concurrency,
                       "cpu_busy_before": busy} | stats
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="requests per round and variant")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="per app (two apps run)")
    ap.add_argument("--deploy-order", default="off,on", choices=["off,on", "on,off"])
    args = ap.parse_args(argv)

    import ray
    import yaml
    from ray import serve

    from rayllm.serve.serving_env import serving_env

    os.environ.update(serving_env())
    hooks_ns = off_hooks_ns()
    sink = Sink()
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        base_args = yaml.safe_load(f)["applications"][0]["args"]
    base_args["engine"]["cache"]["kv_cache_bytes"] = args.kv_cache_bytes
    try:
        urls = deploy(base_args, sink.server_port, port, args.deploy_order.split(","))
        rows = asyncio.run(measure(args, urls))
        time.sleep(7)  # the last batch of spans (every 5 s)
        summarize(args, rows, sink, hooks_ns)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def summarize(args, rows: list[dict], sink: Sink, hooks_ns: float) -> None:
    tps = {v: [r["output_tokens_per_s"] for r in rows if r["variant"] == v] for v in ("off", "on")}
    ttft = {v: [r["ttft_p50_s"] for r in rows if r["variant"] == v] for v in ("off", "on")}
    on_requests = sum(r["completed"] for r in rows if r["variant"] == "on") + 2
    summary = {"bench": "tracing", "summary": True, "concurrency": args.concurrency, "rounds": args.rounds,
               "deploy_order": args.deploy_order,
               "tok_s_off": tps["off"], "tok_s_on": tps["on"],
               "median_tok_s_off": statistics.median(tps["off"]), "median_tok_s_on": statistics.median(tps["on"]),
               "on_over_off": round(statistics.median(tps["on"]) / statistics.median(tps["off"]), 4),
               "median_ttft_p50_off_s": statistics.median(ttft["off"]),
               "median_ttft_p50_on_s": statistics.median(ttft["on"]),
               "spans_received": sink.span_count(), "spans_per_traced_request": None,
               "off_hooks_ns_per_request": round(hooks_ns, 1),
               "errors": sum(r["errors"] for r in rows)}
    pairs = [round(on / off, 4) for on, off in zip(tps["on"], tps["off"], strict=True)]  # each round's own
    summary |= {"round_on_over_off": pairs, "median_round_on_over_off": statistics.median(pairs)}
    summary["spans_per_traced_request"] = round(summary["spans_received"] / on_requests, 2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
