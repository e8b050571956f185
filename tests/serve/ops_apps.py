"""Shared by the operations tests: small extra apps deployed into the session's Serve cluster."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import httpx

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
SMALL_ENGINE = {"model": {"dtype": "float32", "max_model_len": 1024},
                "cache": {"kv_cache_bytes": 96 << 20},
                "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}}


def free_port() -> int:
    """A free port below the kernel's ephemeral range (and above Ray's worker ports, 10002-19999), so no
    client connection or Ray process here can take it between this call and the server's bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # an unusual port range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_haproxy_env() -> dict[str, str]:
    """Free HAProxy stats and metrics ports for one more Serve instance on this machine (Serve's fixed
    defaults would clash; its config and socket files already sit in a per-instance folder)."""
    return {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}


def wait_healthy(base: str, wait_s: float = 300) -> str:
    """Poll `base`/health until it answers 200 (the app's replicas are up); returns `base`."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=15).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{base} did not become healthy in {wait_s:.0f} s")


def run_app(server: str, app, name: str, wait_s: float = 300) -> str:
    """Deploy a built app into the session's Serve instance under /name; its URL once healthy."""
    from ray import serve

    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    return wait_healthy(f"{server}/{name}", wait_s)


def deploy(server: str, name: str, args: dict, wait_s: float = 300) -> str:
    from rayllm.serve.builder import build_app

    small = {} if "models" in args else {"engine": SMALL_ENGINE}  # a `models` list brings its own engines
    return run_app(server, build_app({"replica_num_cpus": 0.5} | small | args), name, wait_s)


def sse_lines(r: httpx.Response) -> list[str]:
    return [ln for ln in r.iter_lines() if ln]


def chat_body(max_tokens: int, stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, **kw}


class Pace:
    """How fast an app serves on this machine now, measured through HTTP at the start of a test, so that
    token counts and time bounds scale with the machine instead of being fixed seconds.

    request_s: a 1-token chat request end to end (HTTP, template, tokenizer, prefill, one step).
    step_s: one more decode step (the slope between a 1-token and a (1 + tokens)-token request).
    """

    def __init__(self, base: str, tokens: int = 32, headers: dict | None = None) -> None:
        def timed(n: int) -> float:
            t0 = time.monotonic()
            r = httpx.post(f"{base}/v1/chat/completions", json=chat_body(n), headers=headers, timeout=600)
            assert r.status_code == 200, r.text
            return time.monotonic() - t0

        timed(1)  # warm: the first request pays one-time costs
        self.request_s = min(timed(1) for _ in range(2))
        self.step_s = max((timed(1 + tokens) - self.request_s) / tokens, 1e-3)

    def tokens_for(self, seconds: float, cap: int) -> int:
        """Enough decode steps to take `seconds` at the measured pace (at most `cap`)."""
        return max(1, min(cap, int(seconds / self.step_s) + 1))

    def bound(self, tokens: int, margin: float = 4.0) -> float:
        """An upper bound for a request of `tokens` steps: `margin` times its measured cost."""
        return margin * (self.request_s + tokens * self.step_s)

    def __repr__(self) -> str:
        return f"Pace(request {self.request_s * 1e3:.0f} ms, step {self.step_s * 1e3:.1f} ms)"
