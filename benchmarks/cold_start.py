"""Cold start of the whole app, as `serve run cluster.yaml` does it, to the first streamed token.

    python benchmarks/cold_start.py [--rounds 2] [--model SOURCE] [--kv-cache-bytes N]

Each round runs in a fresh process (fresh imports, a fresh Ray): Ray start, then Serve deploys cluster.yaml's
own application (the default model unless --model), then one streamed chat request. Prints one JSON line per
round: wall seconds from the process start to Ray up, to the app healthy, and to the first token; and the
model replica's own `cold start` record (download, load to device, KV cache sizing and allocation, CUDA-graph
capture, the engine, the replica constructor: rayllm.serve.llm_server.cold_start_record).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_round(model: str | None, kv_cache_bytes: int) -> dict:
    t0 = time.perf_counter()
    import httpx
    import ray
    import yaml
    from ray import serve

    sys.path.insert(0, ROOT)
    from rayllm.serve.builder import build_app
    from rayllm.serve.serving_env import serving_env

    os.environ.update(serving_env())
    t_import = time.perf_counter() - t0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t_ray = time.perf_counter() - t0
    with open(os.path.join(ROOT, "cluster.yaml")) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    args["engine"]["cache"]["kv_cache_bytes"] = kv_cache_bytes
    if model:
        args["engine"]["model"]["model"] = model
    serve.run(build_app(args), name="llm", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    t_healthy = time.perf_counter() - t0
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    t_first = time.perf_counter() - t0
    record = serve.get_deployment_handle("llm", "llm").cold_start.remote().result()
    serve.shutdown()
    ray.shutdown()
    return {"bench": "cold_start", "imports_s": round(t_import, 2), "ray_up_s": round(t_ray, 2),
            "healthy_s": round(t_healthy, 2), "first_token_s": round(t_first, 2), "replica": record}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one_round(a.model, a.kv_cache_bytes)), flush=True)
        return
    for _ in range(a.rounds):
        cmd = [sys.executable, __file__, "--child", "--kv-cache-bytes", str(a.kv_cache_bytes)]
        cmd += ["--model", a.model] if a.model else []
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        print(lines[-1] if lines else json.dumps({"bench": "cold_start", "error": out.stderr[-2000:]}), flush=True)


if __name__ == "__main__":
    main()
