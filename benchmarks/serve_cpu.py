"""Where the serving path spends CPU: CPU time per output token, per process of a running server.

    python benchmarks/serve_cpu.py [--url http://127.0.0.1:8000] [--concurrency 16] [--requests 64] [--py-spy]

On a machine with few cores every CPU-second the proxy, the ingress, the tokenizer or Ray spends is a
CPU-second the engine does not get, so the serving overhead is best read as CPU time per output token
of each process, not as wall time (which other load on the machine distorts). The script finds the
server's processes (Serve's proxy and replicas, the engine child process, Ray's own daemons) in /proc,
reads their user+system CPU time before and after a closed-loop streaming load (serve_bench's request),
and prints one JSON line: per process group, CPU ms per output token and its share. With `--py-spy`
(`pip install py-spy`) it also samples each group's busiest process while the load runs and lists the
functions with the most own time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_bench import run_point, served_model  # noqa: E402
from serve_prompts import messages_for  # noqa: E402

# The venv's py-spy when the venv is not on PATH (`.venv/bin/python benchmarks/serve_cpu.py`).
PY_SPY = str(Path(sys.executable).with_name("py-spy")) if Path(sys.executable).with_name("py-spy").exists() else "py-spy"

_TICK = os.sysconf("SC_CLK_TCK")


def _group(cmdline: str) -> str | None:
    """A process's role in the server, from its command line (None: not part of it)."""
    if "rayllm.engine.client.engine_process" in cmdline:
        return "engine"
    m = re.search(r"ray::ServeReplica:[^:\s]+:([^\s]+)", cmdline)
    if m:
        return f"replica:{m.group(1)}"
    if "ray::ProxyActor" in cmdline:
        return "proxy"
    if "haproxy" in cmdline.split(" ", 1)[0]:
        return "haproxy"  # RAY_SERVE_ENABLE_HA_PROXY=1: Serve's C proxy in front of the ingress replicas
    if "ray::ServeController" in cmdline:
        return "controller"
    for name in ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env"):
        if name in cmdline:
            return "ray-daemons"
    if "serve run" in cmdline or "ray/serve/scripts" in cmdline:
        return "serve-cli"
    return None


def server_processes() -> dict[int, str]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        group = _group(cmd)
        if group:
            out[int(pid)] = group
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of the process (all its threads): /proc/PID/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15)


def _py_spy(pids: dict[str, int], seconds: float, folder: str) -> dict[str, subprocess.Popen]:
    procs = {}
    for group, pid in pids.items():
        out = os.path.join(folder, f"{group.replace(':', '_')}.txt")
        procs[group] = subprocess.Popen(
            [PY_SPY, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50",
             "--format", "raw", "--output", out, "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return procs


def top_own_time(raw_file: str, n: int = 12) -> list[tuple[str, float]]:
    """py-spy's raw (collapsed-stack) output: the leaf frames with the most samples, as shares."""
    own: Counter[str] = Counter()
    total = 0
    try:
        lines = Path(raw_file).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        if leaf.startswith(("select ", "poll ", "epoll_wait ", "wait ", "_wait_for_tstate_lock ")):
            continue  # idle, not work
        own[leaf] += int(count)
        total += int(count)
    return [(frame, round(c / total, 3)) for frame, c in own.most_common(n)] if total else []


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="the model to ask for (default: the first in /v1/models)")
    ap.add_argument("--label", default="", help="free text carried into the JSON line (e.g. a commit)")
    ap.add_argument("--py-spy", action="store_true", help="also sample each group's busiest process")
    ap.add_argument("--py-spy-seconds", type=float, default=15.0)
    args = ap.parse_args()

    procs = server_processes()
    if not any(g == "engine" or g.startswith("replica:") for g in procs.values()):
        sys.exit("no server processes found (is `serve run cluster.yaml` running on this machine?)")
    async with httpx.AsyncClient(timeout=600) as client:
        model = args.model or await served_model(client, args.url)
        prompts = messages_for("short", args.requests)
        warm = messages_for("short", args.concurrency)
        with tqdm(total=len(warm), desc="warm-up", file=sys.stderr) as bar:
            await run_point(client, args.url, model, warm, args.concurrency, args.max_tokens, 600, bar)
        before = {pid: cpu_seconds(pid) for pid in procs}
        spy_dir = os.environ.get("SERVE_CPU_SPY_DIR") or tempfile.mkdtemp(prefix="serve-cpu-")
        spies = {}
        if args.py_spy:
            busiest: dict[str, int] = {}
            for pid, group in procs.items():
                busiest.setdefault(group, pid)
                if (cpu_seconds(pid) or 0) > (cpu_seconds(busiest[group]) or 0):
                    busiest[group] = pid
            spies = _py_spy({g: p for g, p in busiest.items() if g != "ray-daemons"}, args.py_spy_seconds,
                            spy_dir)
        t0 = time.perf_counter()
        with tqdm(total=len(prompts), desc=f"load x{args.concurrency}", file=sys.stderr) as bar:
            point = await run_point(client, args.url, model, prompts, args.concurrency, args.max_tokens, 900, bar)
        wall = time.perf_counter() - t0
    after = {pid: cpu_seconds(pid) for pid in procs}
    for p in spies.values():
        p.wait(timeout=120)
    used: Counter[str] = Counter()
    for pid, group in procs.items():
        if before.get(pid) is not None and after.get(pid) is not None:
            used[group] += after[pid] - before[pid]
    tokens = point["completion_tokens"]
    total = sum(used.values())
    line = {"bench": "serve_cpu", "label": args.label, "concurrency": args.concurrency,
            "requests": args.requests, "max_tokens": args.max_tokens, "wall_s": round(wall, 2),
            "out_tok_s": point["output_tokens_per_s"], "errors": point["errors"], "output_tokens": tokens, "cpu_s_total": round(total, 2),
            "cpu_ms_per_token": {g: round(1000 * s / max(tokens, 1), 3) for g, s in used.most_common()},
            "cpu_share": {g: round(s / total, 3) for g, s in used.most_common()} if total else {},
            "py_spy_top": {g: top_own_time(os.path.join(spy_dir, f"{g.replace(':', '_')}.txt"))
                           for g in spies}}
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
