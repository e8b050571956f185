"""Prefix-aware routing vs Serve's default router: multi-turn chat over two model replicas.

    flock /tmp/heavy.lock python benchmarks/prefix_router_bench.py [--conversations 64] [--turns 8] [--out F]
        [--serving-nice auto|0..19] [--max-batched-tokens 1024] [--trace]
        [--variants power_of_two,prefix,single] [--rounds 1] [--max-tokens 32] [--system-words 200]

Issue 38's workload: --conversations chats of --turns turns each, all under one shared system prompt of about
--system-words words, each turn a fresh user message and the model's own reply (--max-tokens tokens) added
to the history. The conversations start at once, each one turn after another (a closed loop per user, with
a random pause of mean --think-s before each next turn).
On a 2-core machine, scale it down (e.g. --conversations 16); the JSON says what ran.

Every variant is its own Serve app in one Ray session, deployed before any load starts: `power_of_two`
(two model replicas, Serve's default router), `prefix` (two replicas, rayllm.serve.prefix_router) and
`single` (one replica, the hit rate to compare against); `prefix_abs` is `prefix` with the absolute load
bound alone (`max_load_ratio: 1`). Variants run one at a time, in alternating order
over --rounds; each round writes fresh words, so no variant finds another round's prompts cached.

One JSON line per variant and round: the prefix-cache hit rate (cached / prompt tokens over every
request, and at the last turn), time to first token at the last turn (p50, mean) and over all turns,
requests per replica, and the share of turns that went to the replica of the conversation's previous turn.
A first line (`router_cost`) times the router's own work per request on a 2048-token prompt, without Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serve_stats import percentile  # noqa: E402

WORDS = ("bicycle brake chain wheel saddle pedal gear tyre valve spoke frame fork lever cable light bell "
         "pump rack lock helmet order price repair check replace adjust clean oil tighten loosen route "
         "weather river mountain city morning evening weekend window garden kitchen").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def deploy(base: str, name: str, router: str | dict, replicas: int, args: argparse.Namespace) -> None:
    import httpx
    from ray import serve

    from rayllm.serve.builder import build_app

    app = build_app({"replica_num_cpus": 0.5, "router": router, "stream_interval_s": 0.05,
                     "tracing": getattr(args, "tracing", {"enabled": False}),
                     "serving_nice": args.serving_nice if args.serving_nice == "auto" else int(args.serving_nice),
                     "llm_deployment_options": {"num_replicas": replicas, "max_ongoing_requests": 256},
                     "engine": {"model": {"max_model_len": 4096}, "cache": {"kv_cache_bytes": args.kv_cache_bytes},
                                "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": args.max_batched_tokens},
                                "parallel": {"cpu": {"threads_per_rank": args.threads,
                                                     "threads_single_sequence": args.threads}}}})
    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/{name}/health", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"app {name} did not become healthy")


async def one_turn(http, url: str, messages: list[dict], max_tokens: int, trace: str | None = None) -> dict:
    """A streamed chat request: time to first content, the reply, usage and the serving replica; with `trace`
    (32 hex digits) the request carries it as its W3C traceparent, so the server's spans can be found."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"traceparent": f"00-{trace}-{trace[:16]}-01"} if trace else {}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with http.stream("POST", url, json=body, headers=headers) as r:
        r.raise_for_status()
        replica = r.headers.get("x-replica-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = event.get("usage") or usage
    return {"ttft": ttft, "text": "".join(text), "replica": replica, "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "trace": trace}


async def run_variant(base: str, name: str, args: argparse.Namespace, seed: int) -> list[list[dict]]:
    import httpx

    rng = random.Random(seed)
    system = f"Session {seed}. You are the assistant of a bicycle shop. " + words(rng, args.system_words)
    firsts = [words(rng, args.user_words) for _ in range(args.conversations * args.turns)]
    url = f"{base}/{name}/v1/chat/completions"

    async def conversation(c: int, http) -> list[dict]:
        rng_think = random.Random(seed * 1000 + c)
        messages = [{"role": "system", "content": system}]
        out = []
        for t in range(args.turns):
            messages.append({"role": "user", "content": f"Customer {c}, question {t}: {firsts[c * args.turns + t]}?"})
            trace = uuid.uuid4().hex if args.trace else None  # not from rng_think: the same pauses either way
            result = await one_turn(http, url, messages, args.max_tokens, trace)
            messages.append({"role": "assistant", "content": result["text"]})
            out.append(result)
            await asyncio.sleep(rng_think.uniform(0, 2 * args.think_s))
        return out

    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        return list(await asyncio.gather(*(conversation(c, http) for c in range(args.conversations))))


def summary(variant: str, rnd: int, convs: list[list[dict]], wall_s: float, args: argparse.Namespace,
            spans: list[dict] | None = None) -> dict:
    flat = [t for conv in convs for t in conv]
    last = [conv[-1] for conv in convs]
    per_replica: dict[str, int] = {}
    for t in flat:
        per_replica[t["replica"]] = per_replica.get(t["replica"], 0) + 1
    stay = [a["replica"] == b["replica"] for conv in convs for a, b in zip(conv, conv[1:], strict=False)]

    def rate(ts: list[dict]) -> float:
        return round(sum(t["cached"] for t in ts) / max(1, sum(t["prompt"] for t in ts)), 4)

    def ms(xs: list[float], q: float | None = None) -> float:
        v = percentile(xs, q) if q is not None else sum(xs) / len(xs)
        return round(v * 1e3, 1)

    last_ttft = [t["ttft"] for t in last]
    all_ttft = [t["ttft"] for t in flat]
    return {"bench": "prefix_router", "variant": variant, "round": rnd, "conversations": args.conversations,
            "turns": args.turns, "max_tokens": args.max_tokens, "think_s": args.think_s, "threads": args.threads,
            "serving_nice": args.serving_nice, "kv_cache_bytes": args.kv_cache_bytes,
            "max_batched_tokens": args.max_batched_tokens,
            "hit_rate": rate(flat), "hit_rate_last_turn": rate(last),
            "ttft_last_turn_p50_ms": ms(last_ttft, 50), "ttft_last_turn_mean_ms": ms(last_ttft),
            "ttft_all_p50_ms": ms(all_ttft, 50), "ttft_all_p90_ms": ms(all_ttft, 90),
            "prompt_tokens_last_turn_mean": round(sum(t["prompt"] for t in last) / len(last)),
            "uncached_tokens_last_turn_mean": round(sum(t["prompt"] - t["cached"] for t in last) / len(last)),
            "same_replica_as_previous_turn": round(sum(stay) / max(1, len(stay)), 3),
            "requests_per_replica": sorted(per_replica.values()), "wall_s": round(wall_s, 1)} | (
            {"phases_last_turn": phases(last, spans), "phases_all": phases(flat, spans)} if spans is not None else {})


# Where a turn's time to first token goes, from the server's spans (--trace): the ingress until the model
# replica's span starts (validation, template render, routing), the replica until the engine process adds the
# request (an engine mid-step reads its input after the step), the engine's queue, and its prefill (first
# scheduled -> first token: a whole step, or more when the prompt is chunked).
PHASES = {"ingress": ("POST /v1/chat/completions", "start", "llm.generate", "start"),
          "to_engine": ("llm.generate", "start", "engine.queue", "start"),
          "queue": ("engine.queue", "start", "engine.queue", "end"),
          "prefill": ("engine.prefill", "start", "engine.prefill", "end")}


def phases(turns: list[dict], spans: list[dict]) -> dict:
    """p50 / p90 ms of each phase (PHASES) over `turns`, from the spans of their traces."""
    by_trace: dict[str, dict[str, dict]] = {}
    for s in spans:
        by_trace.setdefault(s["trace"], {}).setdefault(s["name"], s)
    out: dict[str, dict] = {}
    for phase, (a, a_end, b, b_end) in PHASES.items():
        xs = [(t[b][b_end] - t[a][a_end]) / 1e9 for t in (by_trace.get(turn["trace"], {}) for turn in turns)
              if a in t and b in t]
        if xs:
            out[phase] = {"p50_ms": round(percentile(xs, 50) * 1e3, 1), "p90_ms": round(percentile(xs, 90) * 1e3, 1),
                          "n": len(xs)}
    return out


def router_cost(prompt_tokens: int = 2048, n: int = 200) -> dict:
    """The router's own work per request (no Ray): hashing a prompt's blocks, matching them against a table
    of 64 such prompts on each of two replicas, the choice, and recording the blocks."""
    from rayllm.serve.prefix_affinity import PrefixTable, RouterConfig, block_chain, pick

    rng = random.Random(0)
    table, config = PrefixTable(65536), RouterConfig()
    prompts = [[rng.randrange(49152) for _ in range(prompt_tokens)] for _ in range(128)]
    for i, p in enumerate(prompts):
        table.insert(f"r{i % 2}", block_chain(p, 16, None))
    times = []
    for i in range(n):
        p = prompts[i % len(prompts)][: prompt_tokens - 7] + [1, 2, 3, 4, 5, 6, 7]
        t0 = time.perf_counter()
        chain = block_chain(p, 16, None, config.max_prompt_blocks)
        chosen = pick(table.match(chain, ["r0", "r1"]), {"r0": 3, "r1": 2}, 16, config)
        table.insert(chosen, chain)
        times.append(time.perf_counter() - t0)
    return {"bench": "prefix_router", "variant": "router_cost", "prompt_tokens": prompt_tokens,
            "p50_us": round(percentile(times, 50) * 1e6, 1), "p99_us": round(percentile(times, 99) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn (ignore_eos)")
    ap.add_argument("--system-words", type=int, default=200, help="shared system prompt length in words")
    ap.add_argument("--user-words", type=int, default=24)
    ap.add_argument("--think-s", type=float, default=1.0, help="mean pause between a reply and the next turn "
                    "(uniform 0..2x): users do not answer in lockstep")
    ap.add_argument("--variants", default="power_of_two,prefix,single")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per replica's engine (0 = all cores "
                    "each); 1 keeps two replicas on a 2-core machine from taking each other's cores")
    ap.add_argument("--max-batched-tokens", type=int, default=1024, help="the engines' per-step token budget")
    ap.add_argument("--serving-nice", default="auto", help="the apps' serving_nice (auto: +10 on CPU)")
    ap.add_argument("--trace", action="store_true", help="tracing on (to a local OTLP endpoint): each line adds "
                    "where time to first token goes (phases_last_turn, phases_all)")
    ap.add_argument("--out", help="also append the JSON lines to this file (Ray's driver prints its own warnings "
                    "on stdout)")
    args = ap.parse_args()

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")

    emit(router_cost())

    import ray
    from ray import serve

    from rayllm.serve.serving_env import serving_env

    os.environ.update(serving_env())
    sink = None
    if args.trace:
        import threading

        from benchmarks.tracing_bench import Sink

        sink = Sink()
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        args.tracing = {"enabled": True, "otlp_endpoint": f"http://127.0.0.1:{sink.server_port}/v1/traces",
                        "export_interval_s": 1}
    port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    variants = args.variants.split(",")
    shapes = {"power_of_two": ("power_of_two", 2), "prefix": ("prefix", 2), "single": ("power_of_two", 1),
              # the absolute load bound alone (before max_load_ratio): an A/B of the bound
              "prefix_abs": ({"policy": "prefix", "max_load_ratio": 1.0}, 2)}
    try:
        for v in variants:
            t0 = time.perf_counter()
            deploy(base, v, *shapes[v], args)
            print(json.dumps({"bench": "prefix_router", "event": "deployed", "variant": v,
                              "s": round(time.perf_counter() - t0, 1)}), file=sys.stderr, flush=True)
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            lines = {}
            for v in order:
                t0 = time.perf_counter()
                convs = asyncio.run(run_variant(base, v, args, seed=1000 * rnd + 7))
                wall = time.perf_counter() - t0
                if sink is not None:
                    time.sleep(3)  # every process exports its last spans (export_interval_s: 1)
                lines[v] = summary(v, rnd, convs, wall, args, sink.spans() if sink is not None else None)
                emit(lines[v])
            if "prefix" in lines and "power_of_two" in lines:  # issue 38's target: <= 0.6
                emit({"bench": "prefix_router", "event": "ratio", "round": rnd} | {
                    f"prefix_over_power_of_two_{k}": round(lines["prefix"][k] / lines["power_of_two"][k], 3)
                    for k in ("ttft_last_turn_p50_ms", "ttft_last_turn_mean_ms", "ttft_all_p50_ms")})
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
