"""Priority scheduling under a saturating batch load: interactive time to first token against an idle server's.

    flock /tmp/heavy.lock python benchmarks/priority_bench.py [--batch-clients 96] [--interactive 16]
        [--rounds 2] [--variants idle,same,prio_mixed,prio] [--set engine.scheduler.max_num_batched_tokens=256]

Issue 38's target: with a saturating batch load at low priority, interactive requests' time to first token
stays within 2x of an idle server's. Two apps in one Ray session, both cluster.yaml's args as shipped with
`scheduler.policy: priority` (each `--set dotted.key=json` changes one more; the JSON says what ran):
`mixed` with `prompt_steps_alone: false`, `alone` with it true (the default). Variants:

- `idle` (mixed): the interactive requests alone.
- `same` (mixed): beside --batch-clients closed-loop batch clients, every request at the same priority
  (the baseline: what fcfs gives).
- `prio_mixed` (mixed): the same load with the batch at `service_tier: flex` (priority +1), interactive at
  the default; an urgent prompt is computed in a step beside the batch's decode rows.
- `prio` (alone): the same, with the urgent prompt's step leaving the batch out.

Batch requests are non-streamed chats of about --batch-words words of fresh text with --batch-tokens new
tokens (ignore_eos); more clients than `max_num_seqs`, so the engine's queue never empties. Interactive
requests are streamed chats of a fresh short question (--interactive-tokens new tokens) sent open-loop, one
every --interval-s on average, after --warmup-s of load; time to first token is to the first content
delta. Variants alternate order by round. One JSON line per variant and round (TTFT p50 / p90 / mean / max,
the batch's output tok/s, the engine's mean step time, running / waiting when the interactive requests
started, preemptions), then one `ratio` line per round: each loaded variant's TTFT over idle's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.prefix_router_bench import free_port, words  # noqa: E402
from benchmarks.serve_stats import percentile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def app_args(sets: list[str]) -> dict:
    import yaml

    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    args["engine"]["scheduler"]["policy"] = "priority"
    args["storage_url"] = f"sqlite:///{tempfile.mkdtemp(prefix='priority-bench-')}/store.db"
    for item in sets:
        key, value = item.split("=", 1)
        node = args
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = json.loads(value)
    return args


async def engine_stats(handle) -> dict:
    return await handle.stats.remote()  # the engine's counters (EngineStats) as a dict


async def interactive(http, url: str, rng: random.Random, args: argparse.Namespace) -> float:
    """One streamed chat: seconds to its first content delta."""
    body = {"messages": [{"role": "user", "content": f"Quick question: {words(rng, args.interactive_words)}?"}],
            "max_tokens": args.interactive_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    async with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        return time.perf_counter() - t0
    raise RuntimeError("no content streamed")


async def batch_client(http, url: str, seed: int, tier: str | None, args: argparse.Namespace, done: list) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, args.warmup_s / 2))  # staggered: completions spread over the window
    while True:
        body = {"messages": [{"role": "user", "content": "Summarize these notes: " + words(rng, args.batch_words)}],
                "max_tokens": args.batch_tokens, "temperature": 0, "ignore_eos": True}
        if tier:
            body["service_tier"] = tier
        r = await http.post(url, json=body)
        if r.status_code != 200:  # counted (0 tokens) and retried: the load must not thin out silently
            done.append((time.perf_counter(), 0))
            await asyncio.sleep(1.0)
            continue
        done.append((time.perf_counter(), r.json()["usage"]["completion_tokens"]))


VARIANTS = {"idle": ("mixed", None), "same": ("mixed", None), "prio_mixed": ("mixed", "flex"), "prio": ("alone", "flex")}


async def run_variant(base: str, handle, variant: str, seed: int, args: argparse.Namespace) -> dict:
    import httpx

    url = f"{base}/v1/chat/completions"
    tier = VARIANTS[variant][1]
    rng = random.Random(seed)
    done: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=args.batch_clients + args.interactive + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        load = []
        if variant != "idle":
            load = [asyncio.create_task(batch_client(http, url, seed * 1000 + i, tier, args, done))
                    for i in range(args.batch_clients)]
            await asyncio.sleep(args.warmup_s)
        before = await engine_stats(handle)
        t0 = time.perf_counter()
        tasks = []
        for _ in range(args.interactive):
            tasks.append(asyncio.create_task(interactive(http, url, random.Random(rng.random()), args)))
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.interval_s)
        ttfts = list(await asyncio.gather(*tasks))
        elapsed = time.perf_counter() - t0
        after = await engine_stats(handle)
        for t in load:
            t.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    # the aborted batch requests leave the engine before the next variant starts
    deadline = time.time() + 120
    while time.time() < deadline:
        s = await engine_stats(handle)
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        await asyncio.sleep(0.5)
    steps = after["num_steps"] - before["num_steps"]
    tokens = sum(n for t, n in done if t >= t0)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 1)

    return {"bench": "priority", "variant": variant, "app": VARIANTS[variant][0], "n": len(ttfts),
            "ttft_p50_ms": ms(percentile(ttfts, 50)), "ttft_p90_ms": ms(percentile(ttfts, 90)),
            "ttft_mean_ms": ms(sum(ttfts) / len(ttfts)), "ttft_max_ms": ms(max(ttfts)),
            "batch_output_tok_s": round(tokens / elapsed, 1), "batch_errors": sum(1 for _, n in done if n == 0),
            "step_ms_mean": round((after["step_seconds"] - before["step_seconds"]) / max(1, steps) * 1e3, 2),
            "running_at_start": before["num_running"], "waiting_at_start": before["num_waiting"],
            "kv_usage_at_start": round(before["kv_usage"], 3), "kv_usage_at_end": round(after["kv_usage"], 3),
            "preemptions": after["num_preemptions"] - before["num_preemptions"], "wall_s": round(elapsed, 1)}


async def run_round(base: str, variants: list[str], rnd: int, args: argparse.Namespace) -> list[dict]:
    from ray import serve

    out = []
    for v in variants:
        app = VARIANTS[v][0]
        handle = serve.get_deployment_handle("llm", app)
        line = await run_variant(f"{base}/{app}", handle, v, 1000 * rnd + 7, args) | {"round": rnd}
        print(json.dumps(line), flush=True)
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="idle,same,prio_mixed,prio")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-clients", type=int, default=96, help="closed-loop batch clients (> max_num_seqs)")
    ap.add_argument("--batch-words", type=int, default=150)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--interactive", type=int, default=16, help="interactive requests per variant")
    ap.add_argument("--interactive-words", type=int, default=12)
    ap.add_argument("--interactive-tokens", type=int, default=16)
    ap.add_argument("--interval-s", type=float, default=1.0, help="mean gap between interactive requests")
    ap.add_argument("--warmup-s", type=float, default=12.0, help="batch load before the first interactive request")
    ap.add_argument("--set", action="append", default=[], help="dotted.key=json over cluster.yaml's app args")
    args = ap.parse_args()

    import ray
    from ray import serve

    from rayllm.serve.builder import build_app
    from rayllm.serve.serving_env import serving_env

    os.environ.update(serving_env())
    config = app_args(args.set)
    print(json.dumps({"bench": "priority", "event": "config", "args": vars(args),
                      "scheduler": config["engine"]["scheduler"]}), flush=True)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,  # two apps' model replicas at 1 CPU each
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for app, alone in (("mixed", False), ("alone", True)):
            config["engine"]["scheduler"]["prompt_steps_alone"] = alone
            serve.run(build_app(config), name=app, route_prefix=f"/{app}", blocking=False)
            deadline = time.time() + 600
            while True:
                try:
                    if httpx.get(f"{base}/{app}/health", timeout=10).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"the app {app} did not become healthy")
                time.sleep(0.5)
        variants = args.variants.split(",")
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            lines = {x["variant"]: x for x in asyncio.run(run_round(base, order, rnd, args))}
            if "idle" in lines:
                idle = lines["idle"]
                print(json.dumps({"bench": "priority", "event": "ratio", "round": rnd} | {
                    f"{v}_over_idle_{q}": round(lines[v][f"ttft_{q}_ms"] / idle[f"ttft_{q}_ms"], 2)
                    for v in lines if v != "idle" for q in ("p50", "mean")}), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
