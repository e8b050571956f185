"""The tokenizer deployment's round trip for a typical chat request, and where its time goes.

    flock /tmp/rayllm-ray.lock python benchmarks/tokenizer_bench.py [--requests 400] [--concurrency 1,16]
    python benchmarks/tokenizer_bench.py --no-serve      # the in-process stages only (no Ray)

Starts its own Ray session and, per `--variants` setting, a Serve app of two deployments beside the real
`TokenizerDeployment`: `Caller` stands in for the ingress (it calls through a `DeploymentHandle`, as the
ingress does, and times each call in its own replica), and `Echo` answers at once with a reply the size
of render_chat's (Serve's own cost). One JSON line per measurement on stdout, with p50/p99/mean µs and,
for handle paths, the CPU µs per call of the caller and of the called replica (from /proc):

- `handle_render_chat`: ingress -> tokenizer deployment `render_chat` -> back; `handle_encode`: the same
  for `encode` of the rendered prompt (a plain method: Serve runs it in a thread pool);
- `direct_render_chat`: the same render as the ingress makes it (`rayllm.serve.render_batcher`): over the
  tokenizer replica's direct channel (`rayllm.serve.render_channel`, a Unix socket on the same node);
  `batcher_render_chat`: its fallback through the handle, concurrent renders coalesced into
  `render_chat_batch` calls (`renders_per_call` says how many went together);
- `handle_echo`, `handle_echo_sync`: the same trips to a deployment that does nothing (async / plain);
  `actor_echo`: the same reply from a plain Ray actor (no Serve router or replica machinery);
- `socket_echo`: the same request and a reply of that size as JSON over a Unix socket to another process, no
  Ray (the floor of any cross-process call on this machine);
- `inproc_*`: the stages inside the tokenizer replica, timed in this process without Ray:
  `render_chat` (all of it), `messages` (the message checks), `template` (the jinja render), `encode`.

The chat request is what `serve_bench.py` sends plus a system prompt (~32 prompt tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayllm.serve.serving_env import serving_env  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def stats(name: str, times_s: list[float], **extra) -> dict:
    xs = sorted(times_s)

    def pct(q: float) -> float:
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"bench": "tokenizer", "path": name, **extra, "n": len(xs),
            "p50_us": round(pct(50) * 1e6, 1), "p99_us": round(pct(99) * 1e6, 1),
            "mean_us": round(sum(xs) / len(xs) * 1e6, 1)}


def in_process(model_path: str, n: int) -> list[dict]:
    """Each stage of `TokenizerService.render_chat`, timed call by call (no Ray)."""
    from rayllm.serve.tokenizer import TokenizerService

    service = TokenizerService(model_path)
    renderer = service.renderer
    text, ids = service.render_chat(MESSAGES)
    stages = {
        "inproc_render_chat": lambda: service.render_chat(MESSAGES),
        "inproc_messages": lambda: renderer._messages(MESSAGES, renderer.default_template),
        "inproc_template": lambda: renderer.render(MESSAGES),
        "inproc_encode": lambda: service.encode(text, add_special_tokens=False),
    }
    out = []
    for name, fn in stages.items():
        for _ in range(20):
            fn()
        times = [timeit.timeit(fn, number=1) for _ in range(n)]
        out.append(stats(name, times, concurrency=1, prompt_tokens=len(ids)))
    return out


def _echo_server(path: str, reply: bytes) -> None:
    """Answers each length-prefixed JSON request on the Unix socket `path` with `reply` (socket_echo's peer)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                size = int.from_bytes(await reader.readexactly(4), "little")
            except asyncio.IncompleteReadError:
                return
            json.loads(await reader.readexactly(size))
            writer.write(len(reply).to_bytes(4, "little") + reply)

    async def main() -> None:
        await (await asyncio.start_unix_server(handle, path)).serve_forever()

    asyncio.run(main())


def socket_echo(n: int) -> dict:
    """The floor of any call to another process here, without Ray: render_chat's request and a reply of its
    size as JSON over a Unix socket, asyncio on both sides."""
    import multiprocessing
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "echo.sock")
    reply = json.dumps(ECHO_REPLY).encode()
    peer = multiprocessing.get_context("spawn").Process(target=_echo_server, args=(path, reply), daemon=True)
    peer.start()

    async def client() -> list[float]:
        while True:  # until the peer listens
            try:
                reader, writer = await asyncio.open_unix_connection(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.01)
        body = json.dumps(["bench-model", MESSAGES]).encode()
        times = []
        for i in range(n + 20):  # 20 warm-up calls
            t0 = time.perf_counter()
            writer.write(len(body).to_bytes(4, "little") + body)
            size = int.from_bytes(await reader.readexactly(4), "little")
            json.loads(await reader.readexactly(size))
            if i >= 20:
                times.append(time.perf_counter() - t0)
        writer.close()
        return times

    try:
        return stats("socket_echo", asyncio.run(client()), concurrency=1)
    finally:
        peer.kill()


# Ray Serve's per-process switches, per variant: {deployment: env}. `RUN_USER_CODE_IN_SEPARATE_THREAD=0`
# runs a replica's methods on the loop that receives the call (one thread hop less each way);
# `RUN_ROUTER_IN_SEPARATE_LOOP=0` runs a handle's router on the caller's loop (the same, on the caller's side).
VARIANTS: dict[str, dict[str, dict[str, str]]] = {
    "default": {},
    "tokenizer_on_loop": {"tokenizer": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
    "caller_router_on_loop": {"caller": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}},
    "both_on_loop": {"tokenizer": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
                     "echo": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},
                     "caller": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}},
    # serving.env's throughput mode in every replica (HAProxy and direct ingress are the HTTP side's).
    "serving_env": {d: {"RAY_SERVE_THROUGHPUT_OPTIMIZED": serving_env()["RAY_SERVE_THROUGHPUT_OPTIMIZED"],
                        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"} for d in ("tokenizer", "echo", "caller")},
}


def replica_cpu_s(app: str, deployment: str) -> float:
    """CPU seconds (user + system) so far of the replica processes of `app`'s `deployment` (Linux /proc)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"ServeReplica:{app}:{deployment}".encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


# path -> (deployment, method): the tokenizer's chat render (async) and encode (a plain method, which Serve
# runs in a thread pool), and the echo deployment's async and plain answers (Serve alone).
PATHS = {"handle_echo": ("echo", "render_chat"), "handle_echo_sync": ("echo", "render_chat_sync"),
         "handle_render_chat": ("tokenizer", "render_chat"), "handle_encode": ("tokenizer", "encode"),
         "actor_echo": ("actor", "render_chat"),  # a plain Ray actor call: Ray's share of Serve's
         "batcher_render_chat": ("tokenizer", "batcher"),  # rayllm.serve.render_batcher through the handle
         "direct_render_chat": ("tokenizer", "direct")}  # as the ingress renders: the replica's direct channel
ECHO_REPLY = ("x" * 160, list(range(32)))  # the size of a typical render_chat answer
PROMPT_TEXT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital "
               "of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n")


def serve_app(model_name: str, model_path: str, variant: str):
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle

    from rayllm.serve.render_batcher import RenderBatcher
    from rayllm.serve.routes.model_routes import ModelTokenizer
    from rayllm.serve.tokenizer import TokenizerDeployment

    env = VARIANTS[variant]

    def actor_options(name: str) -> dict:
        opts: dict = {"num_cpus": 0}
        if name in env:
            opts["runtime_env"] = {"env_vars": env[name]}
        return opts

    @serve.deployment(name="echo", max_ongoing_requests=1000)
    class Echo:
        reply = ECHO_REPLY

        async def render_chat(self, model: str, messages: list[dict], **kw) -> tuple[str, list[int]]:
            return self.reply

        def render_chat_sync(self, model: str, messages: list[dict], **kw) -> tuple[str, list[int]]:
            return self.reply

    @ray.remote(num_cpus=0)
    class EchoActor:
        reply = ECHO_REPLY

        async def render_chat(self, model: str, messages: list[dict], **kw) -> tuple[str, list[int]]:
            return self.reply

    @serve.deployment(name="caller", max_ongoing_requests=1000)
    class Caller:
        """Times handle calls from inside a replica, as the ingress makes them."""

        def __init__(self, tokenizer: DeploymentHandle, echo: DeploymentHandle):
            self.handles = {"tokenizer": tokenizer, "echo": echo, "actor": EchoActor.remote()}
            bound = ModelTokenizer(tokenizer, model_name)
            self.batchers = {"batcher": RenderBatcher(bound, direct=False), "direct": RenderBatcher(bound)}

        async def measure(self, path: str, n: int, concurrency: int) -> list[float]:
            deployment, method = PATHS[path]
            handle = self.handles[deployment]
            args = (PROMPT_TEXT, False) if method == "encode" else (MESSAGES,)
            times: list[float] = []

            async def client(k: int) -> None:
                for _ in range(k):
                    t0 = time.perf_counter()
                    if method in self.batchers:
                        await self.batchers[method].render(MESSAGES)
                    else:
                        await getattr(handle, method).remote(model_name, *args)
                    times.append(time.perf_counter() - t0)

            await asyncio.gather(*(client(n // concurrency) for _ in range(concurrency)))
            return times

        def batch_calls(self) -> int:
            return sum(b.calls for b in self.batchers.values())

    tokenizer = TokenizerDeployment.options(ray_actor_options=actor_options("tokenizer")).bind({model_name: model_path})
    echo = Echo.options(ray_actor_options=actor_options("echo")).bind()
    return Caller.options(ray_actor_options=actor_options("caller")).bind(tokenizer, echo)


def through_serve(model_name: str, model_path: str, n: int, concurrencies: list[int], rounds: int,
                  variants: list[str], paths: list[str]) -> list[dict]:
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                       "PYTHONPATH": os.pathsep.join(sys.path)}})
    try:
        # WARNING as cluster.yaml: no access-log line per call
        callers = {v: serve.run(serve_app(model_name, model_path, v), name=f"tokenizer_bench_{v}", route_prefix=None,
                                logging_config={"log_level": "WARNING"}) for v in variants}
        out = []
        for c in concurrencies:
            keys = [(v, p) for v in variants for p in paths]
            times: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
            cpu = {k: [0.0, 0.0] for k in keys}  # CPU seconds of the caller and of the called replica
            calls = dict.fromkeys(keys, 0)  # handle calls the batcher made
            for v, p in keys:  # warm-up, not measured
                callers[v].measure.remote(p, 50, c).result()
            for _ in range(rounds):  # alternate, so drifting machine load hits every path alike
                for v, p in keys:
                    app, target = f"tokenizer_bench_{v}", PATHS[p][0]
                    before = replica_cpu_s(app, "caller"), replica_cpu_s(app, target)
                    calls_before = callers[v].batch_calls.remote().result()
                    times[v, p].extend(callers[v].measure.remote(p, n // rounds, c).result())
                    calls[v, p] += callers[v].batch_calls.remote().result() - calls_before
                    cpu[v, p][0] += replica_cpu_s(app, "caller") - before[0]
                    cpu[v, p][1] += replica_cpu_s(app, target) - before[1]
            out.extend(stats(p, ts, variant=v, concurrency=c,
                             cpu_caller_us=round(cpu[v, p][0] / len(ts) * 1e6, 1),
                             cpu_callee_us=None if PATHS[p][0] == "actor" else round(cpu[v, p][1] / len(ts) * 1e6, 1),
                             **({"renders_per_call": round(len(ts) / calls[v, p], 2)} if calls[v, p] else {}))
                       for (v, p), ts in times.items())
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    from rayllm.loader.model_files import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="timed calls per path and concurrency")
    ap.add_argument("--concurrency", default="1,16", help="callers in flight at once (comma list)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of the two handle paths")
    ap.add_argument("--model", default=None, help="a GGUF or Hugging Face directory (default: the default model)")
    ap.add_argument("--variants", default="default",
                    help=f"comma list of Serve settings to compare in one run: {', '.join(VARIANTS)}")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"handle paths to time: {', '.join(PATHS)}")
    ap.add_argument("--no-serve", action="store_true", help="in-process stages only: no Ray")
    args = ap.parse_args(argv)
    path = args.model or default_model_path()
    lines = [*in_process(path, args.requests), socket_echo(args.requests)]
    if not args.no_serve:
        lines += through_serve("bench-model", path, args.requests,
                               [int(c) for c in args.concurrency.split(",") if c.strip()], args.rounds,
                               [v for v in args.variants.split(",") if v.strip()],
                               [p for p in args.paths.split(",") if p.strip()])
    for line in lines:
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
