"""Shared by the operations tests: small extra apps deployed into the session's Serve cluster."""

from __future__ import annotations

import time

import httpx

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
SMALL_ENGINE = {"model": {"dtype": "float32", "max_model_len": 1024},
                "cache": {"kv_cache_bytes": 96 << 20},
                "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}}


def deploy(server: str, name: str, args: dict, wait_s: float = 300) -> str:
    from ray import serve

    from deployments.builder import build_app

    small = {} if "models" in args else {"engine": SMALL_ENGINE}  # a `models` list brings its own engines
    app = build_app({"replica_num_cpus": 0.5} | small | args)
    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    base = f"{server}/{name}"
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=15).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"app {name} did not become healthy")


def sse_lines(r: httpx.Response) -> list[str]:
    return [ln for ln in r.iter_lines() if ln]


def chat_body(max_tokens: int, stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, **kw}
