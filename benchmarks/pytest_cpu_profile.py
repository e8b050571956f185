"""A pytest plugin: each test's wall time, the machine's busy CPU time and the CPU time by kind of process.

    PYTHONPATH=benchmarks CPUPROF_OUT=/tmp/cpuprof.jsonl python -m pytest -q -p pytest_cpu_profile

One JSON line per test (setup to teardown): `wall` seconds, `busy_cpu_s` from /proc/stat (every core), and
`kinds`, the eight process kinds that used most CPU in it (pytest: this process; "pytest (other)": other
pytest processes, such as the other pytest-xdist workers; Ray's daemons, each Serve replica by app and
deployment, the rest by command). Processes that start and end within one test are in `busy_cpu_s`
only. Each test scans /proc twice (a few ms each): the suite runs about a minute longer.
"""

from __future__ import annotations

import json
import os
import time

OUT = os.environ.get("CPUPROF_OUT", "/tmp/cpuprof.jsonl")
HZ = os.sysconf("SC_CLK_TCK")
KINDS = ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "haproxy", "ServeController",
         "ProxyActor", "monitor.py", "default_worker", "postgres", "chrom", "node")


def _busy() -> int:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait


def _kind(pid: str, cmd: str) -> str:
    if "pytest" in cmd:
        return "pytest" if int(pid) == os.getpid() else "pytest (other)"
    if "ServeReplica:" in cmd:
        return "replica:" + cmd.split("ServeReplica:", 1)[1].split()[0][:40]
    return next((k for k in KINDS if k in cmd), cmd.split()[0][-30:] if cmd else "?")


def _processes() -> dict[str, tuple[str, int]]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:  # exited meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[pid] = (_kind(pid, cmd), int(fields[11]) + int(fields[12]))  # utime + stime
    return out


_start: dict = {}


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _start.update(t=time.monotonic(), busy=_busy(), procs=_processes())


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    wall, busy, before = time.monotonic() - _start["t"], _busy() - _start["busy"], _start["procs"]
    kinds: dict[str, float] = {}
    for pid, (kind, ticks) in _processes().items():
        used = ticks - (before[pid][1] if pid in before else 0)
        if used:
            kinds[kind] = kinds.get(kind, 0.0) + used / HZ
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:8]
    with open(OUT, "a") as f:
        f.write(json.dumps({"id": nodeid, "wall": round(wall, 2), "busy_cpu_s": round(busy / HZ, 2),
                            "kinds": {k: round(v, 2) for k, v in top}}) + "\n")
