"""Stopping `serve run cluster.yaml` leaves no process behind and frees the HTTP port, whatever the signal.

The real `serve run` on the shipped cluster.yaml (default model) with the environment `make serve` gives
it (serving.env plus haproxy_guard's paths). "force" stands in for `ray stop --force`, scoped to this
run's processes: that command SIGKILLs every Ray process on the machine by name (never HAProxy), which
would also stop other Ray instances here; killing this run's tree by pid is the same signal to the same
processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from rayllm.serve.serving_env import serving_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).parent / "serve"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _start(tmp_path: Path) -> tuple[subprocess.Popen, int, str]:
    port = _free_port()
    config = (ROOT / "cluster.yaml").read_text().replace("port: 8000", f"port: {port}")
    (tmp_path / "cluster.yaml").write_text(config)
    env = os.environ | serving_env()
    # HAProxy's stats and metrics ports, free ones here (the defaults would clash with other Serve instances).
    stats_port = env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(_free_port())
    env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(_free_port())
    env["PYTHONPATH"] = str(ROOT)
    # Its own session: the signal goes to `serve run` alone, as `kill` would, not to pytest's group.
    proc = subprocess.Popen([str(SERVE), "run", str(tmp_path / "cluster.yaml")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "wb"),
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return proc, port, stats_port
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError("serve run did not come up in 300 s")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "force"])
def test_stop_leaves_nothing(tmp_path: Path, how: str) -> None:
    proc, port, stats_port = _start(tmp_path)
    tree = psutil.Process(proc.pid).children(recursive=True)
    names = {p.pid: p.name() for p in tree}
    assert any(n == "haproxy" for n in names.values()), names  # HAProxy is what used to outlive Ray
    assert any(n == "raylet" for n in names.values()), names
    if how == "force":
        for p in [psutil.Process(proc.pid), *tree]:
            if p.name() != "haproxy":
                p.send_signal(signal.SIGKILL)
    else:
        proc.send_signal(getattr(signal, how))
    gone, alive = psutil.wait_procs(tree, timeout=60)
    for p in alive:  # leave the machine clean before failing
        p.kill()
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    assert not alive, f"after {how}: still running {[(p.pid, names[p.pid]) for p in alive]}"
    # haproxy_guard's watchers leave the tree (double fork): none of this run's may outlive it. Other Serve
    # apps of this test session keep theirs (and start new ones when their HAProxy reloads).
    watchers = _watchers(stats_port)
    assert not psutil.wait_procs(watchers, timeout=10)[1], f"after {how}: haproxy_guard watchers remain"
    assert _port_free(port), f"after {how}: port {port} still bound"


def _watchers(stats_port: str) -> list[psutil.Process]:
    """This run's watchers: the guard's processes that inherited this run's HAProxy stats port."""
    guard = str(serving_env()["RAY_SERVE_HAPROXY_BINARY_PATH"])
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if guard not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            if p.environ().get("RAY_SERVE_HAPROXY_STATS_PORT") == stats_port:
                found.append(p)
        except psutil.Error:  # exited meanwhile
            pass
    return found
