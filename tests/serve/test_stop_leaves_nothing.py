"""Stopping `serve run cluster.yaml` leaves no process behind and frees the HTTP port, whatever the signal; SIGTERM
and Ctrl-C first let a stream in flight finish while new requests, and /health, get an OpenAI-shaped 503 (the
launcher's graceful stop: rayllm/serve/drain.py).

The real `serve run` on the shipped cluster.yaml (default model). The SIGINT (Ctrl-C, what `make serve`'s users
send) and "force" runs start as `make serve` starts it (`python -m rayllm.serve.launch serve run`, serving.env
plus haproxy_guard's paths) with `RAYLLM_RAY_DASHBOARD=0` (no dashboard adds to the three starts). The SIGTERM run
is the container image's command (`docker stop` sends SIGTERM), run as the container would run it: in a folder
laid out as the Dockerfile's WORKDIR (tests/deploy/image_layout.py), with nothing of serving.env in the
environment and Ray's dashboard on (as shipped); it must apply serving.env itself and serve on every interface
(the stream goes to this machine's network address, where `docker run -p` forwards). "force" stands in for
`ray stop --force`, scoped to this run's processes: that command SIGKILLs every Ray process on the machine by
name (never HAProxy), which would also stop other Ray instances here; killing this run's tree by pid is the
same signal to the same processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from rayllm.serve.launch import health_status
from rayllm.serve.serving_env import serving_env
from tests.deploy.image_layout import image_workdir, network_address, path
from tests.deploy.test_deploy import image_cmd
from tests.serve.ops_apps import Pace, free_port, own_haproxy_env

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]  # `make test-fast` skips it; its own Ray: the first pass

ROOT = Path(__file__).resolve().parents[2]
# "force" first: its run, killed at once, then no longer idles (Ray's daemons, Serve's control loop, the replica's
# metrics) beside the graceful stops' runs, which each wait out a stream and Serve's own stop.
HOWS = ("force", "SIGTERM", "SIGINT")


# What the stream in flight at the signal must outlast: the launcher's drain call (a Serve status read and a
# key-value write), the ingress's next read of its flag (drain.WATCH_S, 1 s), /health's turn to 503 and one
# refused request: 0.3-0.9 s after the signal here (session 42; the test prints it). The drain then waits out
# the stream's rest, and a stream slowed by a neighbour (another test lane on these two cores) stretches it: a
# 6 s stream took 41 s in `make test`'s first pass. 4 s keeps over 4x the checks' time at the measured pace.
STREAM_S = 4


@dataclass
class Run:
    proc: subprocess.Popen
    port: int
    stats_port: str
    log: Path
    host: str = "127.0.0.1"  # where a client reaches it


def _launch(run_dir: Path, how: str) -> Run:
    port = free_port()
    # HAProxy's ports its own (the defaults would clash with other Serve instances here).
    if how == "SIGTERM":  # the image's command in the image's layout: it applies serving.env itself
        image_workdir(run_dir)
        cmd, cwd = image_cmd(), run_dir
        config = run_dir / next(w for w in reversed(shlex.split(cmd[-1])) if w.endswith(".yaml"))
        config.write_text(config.read_text().replace("port: 8000", f"port: {port}", 1))
        env = {k: v for k, v in os.environ.items() if k not in serving_env()} | own_haproxy_env()
        env |= {"PATH": path(), "RAYLLM_RAY_DASHBOARD": "1"}
    else:
        (run_dir / "cluster.yaml").write_text((ROOT / "cluster.yaml").read_text().replace("port: 8000", f"port: {port}"))
        cmd, cwd = [sys.executable, "-m", "rayllm.serve.launch", "serve", "run", str(run_dir / "cluster.yaml")], ROOT
        env = os.environ | serving_env() | own_haproxy_env() | {"RAYLLM_RAY_DASHBOARD": "0"}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("RAY_ADDRESS", None)
    log = run_dir / "serve.log"
    # Ctrl-C's disposition as in a terminal: pytest started as a shell's background job (`pytest &`)
    # ignores SIGINT, and a child inherits that, so its `serve run` would ignore the test's SIGINT.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        # Its own session: the signal goes to `serve run` alone, as `kill` would, not to pytest's group.
        # stdout too: `serve run` says there what it does on a signal ("Got KeyboardInterrupt, ...").
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=open(run_dir / "serve.out", "wb"),
                                stderr=open(log, "wb"), start_new_session=True)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    return Run(proc, port, env["RAY_SERVE_HAPROXY_STATS_PORT"], log,
               network_address() if how == "SIGTERM" else "127.0.0.1")


def _wait_up(run: Run, deadline: float) -> None:
    """Until the launcher says the app answers: its "ready" line (its /health answered 200) naming this port."""
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, run.log.read_text()[-3000:]
        if "rayllm: ready in " in (text := run.log.read_text(errors="replace")) and \
                f"http://127.0.0.1:{run.port}/v1 (the OpenAI API" in text:
            return
        time.sleep(1)
    raise AssertionError(f"serve run did not come up in time: {run.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """One `serve run` per way of stopping, started together (each its own Ray instance): their starts
    overlap instead of queueing one behind another."""
    started = {how: _launch(tmp_path_factory.mktemp(how), how) for how in HOWS}
    try:
        deadline = time.monotonic() + 400
        for run in started.values():
            _wait_up(run, deadline)
        yield started
    finally:
        for run in started.values():  # whatever a failed test left
            for p in _tree(run.proc.pid):
                p.kill()
            if run.proc.poll() is None:
                run.proc.kill()
            run.proc.wait(timeout=30)


def _port_free(port: int) -> bool:
    """A server could listen on it again: SO_REUSEADDR, as every server sets, so the closed connections'
    TIME_WAIT entries do not count; a process still listening does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _tree(pid: int) -> list[psutil.Process]:
    """The launcher's descendants still there, each name read at once (psutil keeps it): a short-lived helper
    that exits between the listing and the read is not part of what must stop (CI saw one go, 2026-11-29)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    live = []
    for p in children:
        try:
            p.name()
        except psutil.NoSuchProcess:
            continue
        live.append(p)
    return live


class Stream(threading.Thread):
    """A chat completion streamed through the OpenAI SDK: `started` at its first token; then its token count
    and finish reason, or the error that ended it."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.max_tokens = base_url, max_tokens
        self.started = threading.Event()
        self.tokens, self.finish, self.error = 0, None, None

    def run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)
        try:
            for chunk in client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", stream=True, max_tokens=self.max_tokens, temperature=0,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}]):
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    self.tokens = chunk.usage.completion_tokens
                self.started.set()
        except Exception as exc:  # the stream cut: what the graceful stop prevents
            self.error = exc
        self.started.set()


def test_the_readme_chat_example_names_paris_as_shipped(runs: dict[str, Run]) -> None:
    """The README's first example through the OpenAI SDK on a run started as `make serve` starts it: cluster.yaml
    as shipped (the 4-bit small-batch kernels with int8 activations up to 256-token steps, oneDNN's bf16 GEMMs
    above; the Serve pass's batch-invariant apps run those kernels at every step size) names Paris (issue 35)."""
    from openai import OpenAI

    readme = (ROOT / "README.md").read_text()
    question = re.search(r'"role": "user", "content": "([^"]+)"', readme).group(1)
    assert "capital of France" in question
    run = runs["SIGINT"]
    client = OpenAI(base_url=f"http://{run.host}:{run.port}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0,
                                           messages=[{"role": "user", "content": question}])
    assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content


@pytest.mark.parametrize("how", HOWS)
def test_stop_leaves_nothing(runs: dict[str, Run], how: str) -> None:
    run = runs[how]
    proc = run.proc
    tree = _tree(proc.pid)
    names = {p.pid: p.name() for p in tree}
    assert any(n == "haproxy" for n in names.values()), names  # HAProxy is what used to outlive Ray
    assert any(n == "raylet" for n in names.values()), names
    if how == "SIGTERM":  # the image's command applied serving.env (the process its shell `exec`ed)
        launched = psutil.Process(proc.pid).environ()
        assert {k: launched.get(k) for k in serving_env()} == serving_env()
    stream = None
    if how == "force":
        for p in [psutil.Process(proc.pid), *tree]:
            if p.name() != "haproxy":
                with contextlib.suppress(psutil.NoSuchProcess):  # gone on its own meanwhile
                    p.send_signal(signal.SIGKILL)
    else:
        # SIGTERM (docker stop, systemd) and Ctrl-C drain: a stream open at the signal runs to its end, while
        # new requests get a 503 (and /health too). The stream lasts ~STREAM_S at this machine's pace: open
        # through the drain's start (the ingress reads its flag every second) and the requests below.
        base = f"http://{run.host}:{run.port}"
        pace = Pace(base)
        tokens = pace.tokens_for(STREAM_S, cap=4096)
        stream = Stream(f"{base}/v1", max_tokens=tokens)
        stream.start()
        assert stream.started.wait(60) and stream.error is None, stream.error
        assert stream.is_alive(), f"the stream of {tokens} tokens ended before the signal ({pace})"
        t_signal = time.monotonic()
        if how == "SIGINT":  # Ctrl-C in a terminal signals the whole foreground group (Ray's daemons too)
            os.killpg(proc.pid, signal.SIGINT)
        else:  # docker stop, kill: the launcher alone
            proc.send_signal(signal.SIGTERM)
        _check_refused_while_draining(base, stream, run)
        checked_s = time.monotonic() - t_signal
        stream.join(pace.bound(tokens) + 60)
        print(f"{how}: refusals checked {checked_s:.1f} s after the signal, the stream of {tokens} tokens done "
              f"{time.monotonic() - t_signal:.1f} s after it ({pace})")
        assert (stream.error, stream.finish, stream.tokens) == (None, "length", tokens), run.log.read_text()[-2000:]
    gone, alive = psutil.wait_procs(tree, timeout=60)
    for p in alive:  # leave the machine clean before failing
        p.kill()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    if stream is not None:
        assert proc.returncode == 0, run.log.read_text()[-2000:]  # the graceful stop ends as Ctrl-C does
        assert f"rayllm: {how}: stopping" in run.log.read_text()
        assert "rayllm: the requests in flight finished after" in run.log.read_text()  # before the deletion
    assert not alive, (f"after {how}: still running {[(p.pid, names[p.pid]) for p in alive]}; serve run's "
                       f"stdout: {run.log.with_name('serve.out').read_text(errors='replace')[-2000:]}")
    # haproxy_guard's watchers leave the tree (double fork): none of this run's may outlive it.
    watchers = _watchers(run.stats_port)
    assert not psutil.wait_procs(watchers, timeout=10)[1], f"after {how}: haproxy_guard watchers remain"
    assert _port_free(run.port), f"after {how}: port {run.port} still bound by {_holders(run.port)}"


def _check_refused_while_draining(base: str, stream: Stream, run: Run) -> None:
    """After the stop signal, with `stream` still open: /health turns 503 (a load balancer takes the instance
    out), and a new request gets a 503 that the OpenAI SDK reads as a retryable server error, not Serve's 404."""
    from openai import APIStatusError, OpenAI

    deadline = time.monotonic() + 20
    while (status := health_status(base, timeout_s=10)) == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 503, (status, stream.is_alive(), stream.tokens, run.log.read_text()[-2000:])
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(APIStatusError) as refused:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}])
    err = refused.value
    assert (err.status_code, err.code, err.type) == (503, "server_shutting_down", "server_error"), err.body
    # cluster.yaml's retry_after_s. (The ingress's `Connection: close` ends at HAProxy, which keeps the client's
    # connection: tests/serve/test_drain.py checks it at the ingress.)
    assert err.response.headers["retry-after"] == "1", err.response.headers
    assert stream.is_alive() and stream.error is None, "the stream ended before the refusals were checked"


def _holders(port: int) -> list[tuple[int | None, str]]:
    """Who holds the port (pid, process name), for the failure message."""
    held = []
    for c in psutil.net_connections("inet"):
        if c.laddr and c.laddr.port == port:
            name = psutil.Process(c.pid).name() if c.pid and psutil.pid_exists(c.pid) else "?"
            held.append((c.pid, f"{name} {c.status}"))
    return held


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
