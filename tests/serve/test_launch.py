"""rayllm.serve.launch: which `serve run` command lines it starts the local Ray for (with or without Ray's
dashboard), and which it leaves to `serve run`'s own ray.init; its stop signals' handler; which URLs it watches,
and its "ready" line against a real HTTP server. The launch itself runs in benchmarks/cold_start.py --mode make
(docs/benchmarks.md) and in tests/serve/test_stop_leaves_nothing.py (its "ready" line, and a stream in flight
through SIGTERM and Ctrl-C); no Ray starts here."""

from __future__ import annotations

import io
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rayllm.serve.launch import (
    USAGE,
    GracefulStop,
    announce_when_ready,
    app_urls,
    client_connections,
    open_api_warning,
    starts_ray_here,
    with_dashboard,
)

ROOT = Path(__file__).resolve().parents[2]

NO_DASHBOARD = {"RAYLLM_RAY_DASHBOARD": "0"}


def test_the_local_ray_is_started_here_with_the_dashboard_unless_turned_off():
    assert starts_ray_here(["cluster.yaml"], {}) and with_dashboard({})
    assert starts_ray_here(["cluster.yaml"], NO_DASHBOARD) and not with_dashboard(NO_DASHBOARD)
    assert starts_ray_here(["--blocking", "-d", ".", "cluster.yaml"], {"RAYLLM_RAY_DASHBOARD": "false"})
    assert not with_dashboard({"RAYLLM_RAY_DASHBOARD": "false"}) and with_dashboard({"RAYLLM_RAY_DASHBOARD": "1"})


@pytest.mark.parametrize("args", [["--address", "auto", "c.yaml"], ["-a", "ray://h:10001", "c.yaml"],
                                  ["--address=auto", "c.yaml"], ["--runtime-env", "env.yaml", "c.yaml"],
                                  ["--runtime-env-json={}", "c.yaml"], ["--working-dir", "/src", "c.yaml"]])
def test_options_that_reach_serve_runs_own_ray_init_leave_it_to_serve_run(args):
    assert not starts_ray_here(args, NO_DASHBOARD)


@pytest.mark.parametrize("env", [{"RAY_ADDRESS": "127.0.0.1:6379"}, {"RAY_ADDRESS": "auto", **NO_DASHBOARD}])
def test_an_existing_cluster_is_left_to_serve_run(env):
    assert not starts_ray_here(["cluster.yaml"], env)


def test_client_connections_are_the_established_ones_to_our_ports():
    """Read from the kernel's tables: a connection accepted on the port is listed until it closes; the listening
    socket and other ports are not."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_server(("127.0.0.1", 0)) as other:
        port = server.getsockname()[1]
        assert client_connections({port}) == set()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        elsewhere = socket.create_connection(other.getsockname())
        found = client_connections({port})
        assert len(found) == 1
        ((local, remote),) = found
        assert int(local.rsplit(":", 1)[1], 16) == port
        assert int(remote.rsplit(":", 1)[1], 16) == client.getsockname()[1]
        for s in (client, accepted, elsewhere):
            s.close()
        assert client_connections({port}) == set()


def test_first_stop_signal_drains_then_interrupts_and_a_second_stops_at_once():
    """The handler as signal.signal calls it: the first signal drains in a thread and then interrupts the main
    thread (serve run's Ctrl-C path); one while draining raises KeyboardInterrupt (that path at once)."""
    release, events = threading.Event(), []

    def drain():
        events.append("drain")
        release.wait(10)

    interrupted = threading.Event()
    out = io.StringIO()
    stop = GracefulStop(drain, lambda: (events.append("interrupt"), interrupted.set()), out)
    stop(signal.SIGTERM, None)
    with pytest.raises(KeyboardInterrupt):
        stop(signal.SIGINT, None)
    assert events == ["drain"]  # still draining
    release.set()
    assert interrupted.wait(10) and events == ["drain", "interrupt"]
    assert out.getvalue().startswith("rayllm: SIGTERM: stopping")

    failing = GracefulStop(lambda: 1 / 0, lambda: interrupted.set(), out := io.StringIO())
    interrupted.clear()
    failing(signal.SIGINT, None)  # a failed drain still stops
    assert interrupted.wait(10) and "draining failed (ZeroDivisionError" in out.getvalue()


def test_anything_but_serve_run_is_refused_before_ray_starts():
    out = subprocess.run([sys.executable, "-m", "rayllm.serve.launch", "serve", "deploy", "cluster.yaml"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and USAGE in out.stderr


def test_the_watched_urls_follow_the_config(tmp_path):
    assert app_urls([str(ROOT / "cluster.yaml")]) == ["http://127.0.0.1:8000"]
    config = tmp_path / "c.yaml"
    config.write_text("http_options: {host: 0.0.0.0, port: 9123}\n"
                      "applications:\n  - {name: a, route_prefix: /a/, import_path: x:y}\n  - {name: b, import_path: x:z}\n")
    assert app_urls(["--blocking", str(config)]) == ["http://127.0.0.1:9123/a", "http://127.0.0.1:9123"]
    assert app_urls(["rayllm.serve.builder:build_app"]) == ["http://127.0.0.1:8000"]  # serve run's defaults


@pytest.fixture()
def health_server():
    """A real HTTP server whose /health answers 503 to its first three requests, then 200."""
    seen: list[str] = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200 if len(seen) > 3 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/llm", seen
    server.shutdown()


def test_ready_line_once_health_answers_200_and_progress_meanwhile(health_server):
    url, seen = health_server
    out = io.StringIO()
    announce_when_ready([url], out=out, poll_s=0.01, progress_s=0.0)
    lines = out.getvalue().splitlines()
    assert seen == ["/llm/health"] * 4  # polled until the first 200, then no more
    assert lines[-1].startswith("rayllm: ready in ") and lines[-1].endswith(f"s: {url}/v1 (the OpenAI API; {url}/health)")
    assert any(line.startswith("rayllm: still starting after") and f"{url}/health: 503" in line for line in lines[:-1])


def test_no_server_is_reported_as_no_answer_until_stopped():
    out, stop = io.StringIO(), threading.Event()
    watch = threading.Thread(target=announce_when_ready, args=(["http://127.0.0.1:9"],),
                             kwargs={"out": out, "poll_s": 0.01, "progress_s": 0.05, "stop": stop})
    watch.start()
    for _ in range(500):
        if "no answer" in out.getvalue():
            break
        watch.join(0.01)
    stop.set()
    watch.join(5)
    assert not watch.is_alive()
    assert "http://127.0.0.1:9/health: no answer" in out.getvalue() and "ready" not in out.getvalue()


def test_an_open_api_on_all_interfaces_is_warned_of(tmp_path):
    """The image's config (cluster.yaml rendered to listen on 0.0.0.0, as the Dockerfile does) with no API key
    draws the warning; cluster.yaml itself (127.0.0.1) and the same image with API_KEYS set do not."""
    rendered = subprocess.run([sys.executable, "deploy/render_rayservice.py", "--listen-all", "cluster.yaml"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pod = tmp_path / "cluster-pod.yaml"
    pod.write_text(rendered)
    warning = open_api_warning([str(pod)], {})
    assert warning is not None and "0.0.0.0:8000" in warning and "API_KEYS" in warning
    assert open_api_warning([str(pod)], {"API_KEYS": "sk-a"}) is None
    assert open_api_warning([str(ROOT / "cluster.yaml")], {}) is None
    keyed = tmp_path / "keyed.yaml"
    keyed.write_text(rendered.replace("api_keys: []", "api_keys: [sk-a]", 1))
    assert "api_keys: [sk-a]" in keyed.read_text() and open_api_warning([str(keyed)], {}) is None
