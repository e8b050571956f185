"""Where an interactive request's time to first token goes, idle and under a saturating flex batch, from the
app's own OpenTelemetry spans (issue 38).

    python benchmarks/priority_phases.py [--set serving_nice=0] [--requests 12]

One app with cluster.yaml's args plus `scheduler.policy: priority` and tracing on at `sample_ratio: 0`: only
the interactive requests are traced, each sent with a sampled W3C `traceparent` of its own, so the batch load
(priority_bench.py's 96 closed-loop flex clients) exports nothing. Spans go over OTLP/HTTP to a receiver in
this process. Prints one JSON line per phase set (`idle`, then `loaded` after 12 s of load): the requests'
TTFT p50 (to the first content delta) and, per span name, the median start (ms after the request was sent)
and duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.prefix_router_bench import free_port  # noqa: E402
from benchmarks.priority_bench import app_args, batch_client, words  # noqa: E402
from benchmarks.tracing_bench import Sink  # noqa: E402


async def interactive(http: httpx.AsyncClient, url: str, rng: random.Random, n: int, loaded: bool, args) -> dict:
    """`n` traced streamed chats, 0.2-1.8 s apart (after 12 s of batch load when `loaded`): trace id -> (TTFT s,
    send time in ns since the epoch)."""
    done: list = []
    load = [asyncio.create_task(batch_client(http, url, 100 + i, "flex", args, done))
            for i in range(args.batch_clients if loaded else 0)]
    await asyncio.sleep(args.warmup_s if loaded else 1)
    sent = {}
    for _ in range(n):
        trace_id = secrets.token_hex(16)
        body = {"messages": [{"role": "user", "content": f"Quick question: {words(rng, 12)}?"}], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True, "stream": True}
        t0, wall = time.perf_counter(), time.time_ns()
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        async with http.stream("POST", url, json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    break
        sent[trace_id] = (time.perf_counter() - t0, wall)
        await asyncio.sleep(rng.uniform(0.2, 1.8))
    for task in load:
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    return sent


def decoded(sink: Sink) -> list[dict]:
    """Every span the sink received: name, trace id, start and end (ns)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return [{"name": sp.name, "trace": sp.trace_id.hex(), "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano}
            for body in list(sink.bodies) for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans for sp in ss.spans]


def phases(label: str, sent: dict, spans: list[dict]) -> dict:
    by_name: dict[str, list[tuple[float, float]]] = {}
    for trace_id, (_, wall) in sent.items():
        for s in spans:
            if s["trace"] == trace_id:
                by_name.setdefault(s["name"], []).append(((s["start"] - wall) / 1e6, (s["end"] - s["start"]) / 1e6))
    return {"bench": "priority_phases", "phase": label, "n": len(sent),
            "ttft_p50_ms": round(1000 * statistics.median(t for t, _ in sent.values()), 1),
            "spans": {name: {"n": len(v), "start_ms_p50": round(statistics.median(x[0] for x in v), 1),
                             "duration_ms_p50": round(statistics.median(x[1] for x in v), 1)}
                      for name, v in sorted(by_name.items(), key=lambda kv: statistics.median(x[0] for x in kv[1]))}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=12, help="interactive requests per phase")
    ap.add_argument("--batch-clients", type=int, default=96)
    ap.add_argument("--batch-words", type=int, default=150)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--warmup-s", type=float, default=12.0)
    ap.add_argument("--set", action="append", default=[], help="dotted.key=json over cluster.yaml's app args")
    args = ap.parse_args()

    import ray
    from ray import serve

    from rayllm.serve.builder import build_app
    from rayllm.serve.serving_env import serving_env

    sink = Sink()
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    os.environ.update(serving_env())
    config = app_args(args.set)
    config["tracing"] = {"enabled": True, "sample_ratio": 0.0, "export_interval_s": 1,
                         "otlp_endpoint": f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"}
    print(json.dumps({"bench": "priority_phases", "event": "config", "args": vars(args)}), flush=True)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(config), name="p", route_prefix="/p", blocking=False)
        base = f"http://127.0.0.1:{port}/p"
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("the app did not become healthy")
            time.sleep(0.5)

        async def run(loaded: bool) -> dict:
            async with httpx.AsyncClient(timeout=600) as http:
                return await interactive(http, f"{base}/v1/chat/completions", random.Random(5), args.requests, loaded, args)

        sent = {"idle": asyncio.run(run(False)), "loaded": asyncio.run(run(True))}
        time.sleep(4)  # two export intervals
        spans = decoded(sink)
        for label, batch in sent.items():
            print(json.dumps(phases(label, batch, spans)), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
