"""`make serve`'s launcher: `python -m rayllm.serve.launch serve run [serve run's options] cluster.yaml`.

Ray Serve's own `serve run`, unchanged (the same config, application build and exit), with three additions:

- It starts the local Ray that `serve run` would start with `ray.init()`'s defaults itself, so that it can take
  the stop signals after Ray has set its own (below). `RAYLLM_RAY_DASHBOARD=0` leaves Ray's dashboard out:
  `ray.init` waits for the dashboard's web server and its module processes before it starts the raylet, about
  2 s of `make serve`'s cold start on two cores (docs/benchmarks.md). The dashboard stays on by default because
  `serve status` / `serve config`, `ray list ...` and its web UI need it; Ray's metrics agent (the `ray_vllm_*`
  exporter of docs/operations.md) runs either way. Where `serve run` would not start a local Ray (RAY_ADDRESS
  set, or `--address`) or would start it with a runtime environment (`--runtime-env`, `--runtime-env-json`,
  `--working-dir`), it runs as it is.
- A graceful stop: the first SIGTERM (`docker stop`, systemd, `kill`) or Ctrl-C drains the ingress replicas
  (rayllm/serve/drain.py: new requests, /health too, get an OpenAI-shaped 503 with Retry-After while the
  requests in flight finish, for up to their `graceful_shutdown_timeout_s`), then deletes every application
  (its replicas stop), then ends Serve and Ray as `serve run`'s Ctrl-C does. A second signal ends them at
  once. (`serve run` alone would cut open streams: Ray's driver exits on SIGTERM, and Serve's shutdown stops
  the HTTP proxy with the replicas. Serve's `serve.delete` alone drains the replicas but takes the route out
  of the proxy at once: new requests would get its plain-text 404.)
- `serve run` returns to its log once the config is submitted, before any replica is up, so the launcher also
  says when the app answers: it polls each application's `/health` (every 0.5 s, one cheap request) and prints
  `rayllm: ready in N s: URL/v1` on stderr at its first 200, or a line every 30 s while it does not.
"""

from __future__ import annotations

import http.client
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TextIO
from urllib.parse import urlsplit

# serve run's options that reach its own ray.init: with any of them, serve run starts (or joins) Ray itself.
RAY_INIT_OPTIONS = ("--address", "-a", "--runtime-env", "--runtime-env-json", "--working-dir")
USAGE = "usage: python -m rayllm.serve.launch serve run [serve run's options] CONFIG_OR_IMPORT_PATH"


def starts_ray_here(run_args: list[str], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this launcher starts the local Ray before `serve run` gets run_args: where `serve run` would
    start one with ray.init()'s defaults."""
    if environ.get("RAY_ADDRESS"):
        return False
    return not any(a == opt or a.startswith(opt + "=") for a in run_args for opt in RAY_INIT_OPTIONS)


def with_dashboard(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("RAYLLM_RAY_DASHBOARD", "1").lower() not in ("0", "false", "no")


class GracefulStop:
    """The stop signals' handler (SIGTERM, SIGINT). The first: `drain` in a thread (delete the applications and
    wait for them to go: their replicas drain first), then `interrupt` the main thread, where `serve run`'s
    Ctrl-C path ends Serve; a signal while draining: that path at once."""

    def __init__(self, drain: Callable[[], None], interrupt: Callable[[], None], out: TextIO = sys.stderr) -> None:
        self.drain, self.interrupt, self.out = drain, interrupt, out
        self.stopping = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.stopping:
            raise KeyboardInterrupt  # serve run's own Ctrl-C path: Serve shut down now
        self.stopping = True
        print(f"rayllm: {signal.Signals(signum).name}: stopping; requests in flight finish first (again to stop "
              "now)", file=self.out, flush=True)
        threading.Thread(target=self._drain_then_stop, daemon=True, name="rayllm-stop").start()

    def _drain_then_stop(self) -> None:
        try:
            self.drain()
        except Exception as exc:  # stop anyway: this was asked for
            print(f"rayllm: draining failed ({type(exc).__name__}: {exc}); stopping now", file=self.out, flush=True)
        self.interrupt()


def client_connections(ports: set[int], proc_net: str = "/proc/net") -> set[tuple[str, str]]:
    """The established TCP connections whose local end is one of `ports` (what clients hold open to this
    server), as (local, remote) address pairs from the kernel's tables (Linux; elsewhere none)."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, table)) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) in ports:  # 01: ESTABLISHED
                found.add((fields[1], fields[2]))
    return found


def ingress_replicas(app: str) -> int:
    """The application's running ingress replicas in Serve's status (0: it has no `ingress` deployment)."""
    from ray import serve

    status = serve.status().applications.get(app)
    ingress = status.deployments.get("ingress") if status is not None else None
    return ingress.replica_states.get("RUNNING", 0) if ingress is not None else 0


def wait_for_open_requests(apps: list[str], ack_s: float = 5.0, poll_s: float = 0.5,
                           clock: Callable[[], float] = time.monotonic) -> int:
    """After begin_drain: wait until every running ingress replica of `apps` reported no open request, each
    at most its graceful_shutdown_timeout_s; one that has not reported within ack_s (its watcher reads the
    flag every drain.WATCH_S) is not waited for. Returns the requests still open when it stopped waiting."""
    from rayllm.serve.drain import open_requests

    start = clock()
    while True:
        still, waiting = 0, False
        for app in apps:
            reports = open_requests(app)
            still += sum(int(r["open"]) for r in reports.values())
            grace_s = max((float(r["grace_s"]) for r in reports.values()), default=0.0)
            unacked = len(reports) < ingress_replicas(app) and clock() - start < ack_s
            waiting |= unacked or (any(r["open"] for r in reports.values()) and clock() - start < grace_s)
        if not waiting:
            return still
        time.sleep(poll_s)


def drain_applications(ports: set[int], wait_s: float = 180.0, flush_s: float = 30.0, poll_s: float = 0.5,
                       out: TextIO = sys.stderr) -> None:
    """Drain, then delete every Serve application and wait until they are gone. Draining (rayllm.serve.drain):
    the ingress replicas answer new requests with a 503 (OpenAI-shaped, Retry-After; /health too, so a load
    balancer takes this instance out) until the requests in flight have finished, each replica waiting at
    most its graceful_shutdown_timeout_s. Deleting an application takes its route out of the proxy (new
    requests: Serve's 404), and Serve stops its replicas once their requests finished (within the same
    timeout; `wait_s` bounds the whole wait beyond that). Then wait (up to `flush_s`) for the client
    connections open at the start to close: a finished response can still sit in the proxies' buffers for a
    slow client, and stopping Serve stops the proxies."""
    from ray import serve

    from rayllm.serve.drain import begin_drain

    held = client_connections(ports)
    names = list(serve.status().applications)
    begin_drain(names)
    start = time.monotonic()
    cut = wait_for_open_requests(names, poll_s=poll_s)
    print(f"rayllm: {f'{cut} requests still in flight' if cut else 'the requests in flight finished'} after "
          f"{time.monotonic() - start:.1f} s of draining; deleting the applications", file=out, flush=True)
    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + wait_s
    while (left := [n for n in serve.status().applications if n in names]) and time.monotonic() < deadline:
        time.sleep(poll_s)
    flush_deadline = time.monotonic() + flush_s
    while (open_ := held & client_connections(ports)) and time.monotonic() < flush_deadline:
        time.sleep(poll_s / 5)
    print(f"rayllm: {'drained' if not left else 'stopping with ' + ', '.join(left) + ' still draining'}"
          + (f" ({len(open_)} client connections still open)" if open_ else ""), file=out, flush=True)


def serve_config(run_args: list[str]) -> dict:
    """The Serve config file run_args name (empty for an import path)."""
    import yaml

    config_path = next((a for a in run_args if a.endswith((".yaml", ".yml")) and os.path.isfile(a)), None)
    if config_path is None:
        return {}
    with open(config_path) as f:
        return yaml.safe_load(f) or {}


def app_urls(run_args: list[str]) -> list[str]:
    """The base URL of each application `serve run` with run_args serves: the config file's `http_options`
    and route prefixes (Serve's defaults where it names none); 127.0.0.1:8000/ for an import path."""
    config = serve_config(run_args)
    http = config.get("http_options") or {}
    host = str(http.get("host") or "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # poll locally what listens on all interfaces
    base = f"http://{host}:{int(http.get('port') or 8000)}"
    prefixes = [str(app.get("route_prefix") or "/") for app in config.get("applications") or []] or ["/"]
    return [base + prefix.rstrip("/") for prefix in prefixes]


def open_api_warning(run_args: list[str], environ: Mapping[str, str] = os.environ) -> str | None:
    """A warning line when the config listens beyond loopback while an application takes no API key (the
    image's config listens on 0.0.0.0): anyone who reaches the port may then use the API."""
    config = serve_config(run_args)
    http = config.get("http_options") or {}
    host = str(http.get("host") or "127.0.0.1")
    if host in ("127.0.0.1", "localhost", "::1") or environ.get("API_KEYS", "").strip():
        return None
    open_apps = [str(app.get("name") or "default") for app in config.get("applications") or []
                 if not (app.get("args") or {}).get("api_keys")]
    if not open_apps:
        return None
    return (f"rayllm: WARNING: HTTP listens on {host}:{int(http.get('port') or 8000)} and {', '.join(open_apps)} "
            "takes no API key: anyone who can reach that port can use the API. Set API_KEYS (comma-separated) "
            "or args.api_keys (docs/security.md).")


def health_status(url: str, timeout_s: float = 2.0) -> int | None:
    """GET url/health: its status code, or None when nothing answers."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", f"{parts.path}/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def announce_when_ready(urls: list[str], out: TextIO = sys.stderr, poll_s: float = 0.5, progress_s: float = 30.0,
                        stop: threading.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """Poll each URL's /health until it answers 200 and print one line then; while one does not, a line
    every progress_s saying what it answers. Returns once all answered (or `stop` is set)."""
    stop = stop or threading.Event()
    start = clock()
    pending, last = list(urls), {}
    next_progress = start + progress_s
    while pending and not stop.is_set():
        for url in list(pending):
            last[url] = health_status(url)
            if last[url] == 200:
                print(f"rayllm: ready in {clock() - start:.1f} s: {url}/v1 (the OpenAI API; {url}/health)",
                      file=out, flush=True)
                pending.remove(url)
        if pending and clock() >= next_progress:
            answers = ", ".join(f"{u}/health: {last.get(u) or 'no answer'}" for u in pending)
            print(f"rayllm: still starting after {clock() - start:.0f} s ({answers})", file=out, flush=True)
            next_progress += progress_s
        stop.wait(poll_s)


def main(argv: list[str]) -> None:
    if argv[:2] != ["serve", "run"]:
        sys.exit(USAGE)
    urls = app_urls(argv[2:])
    warning = open_api_warning(argv[2:])
    if warning:
        print(warning, file=sys.stderr, flush=True)
    threading.Thread(target=announce_when_ready, args=(urls,), daemon=True,
                     name="rayllm-ready").start()
    if starts_ray_here(argv[2:]):
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE
        from ray.serve.scripts import parse_runtime_env_args

        # What serve run passes to ray.init when given no Ray options; the dashboard as RAYLLM_RAY_DASHBOARD says.
        ray.init(address=None, namespace=SERVE_NAMESPACE, include_dashboard=None if with_dashboard() else False,
                 runtime_env=parse_runtime_env_args(runtime_env=None, runtime_env_json=None, working_dir=None))
        # After ray.init, which set its own SIGTERM handler (exit at once, cutting open streams).
        # A real signal to the main thread: it wakes serve run's sleep there (interrupt_main would wait it out).
        main_thread = threading.main_thread().ident
        ports = {urlsplit(url).port or 80 for url in urls}
        stop = GracefulStop(lambda: drain_applications(ports), lambda: signal.pthread_kill(main_thread, signal.SIGINT))
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    from ray.serve.scripts import cli

    cli.main(args=argv[1:], prog_name="serve")  # serve run skips its ray.init when Ray is up


if __name__ == "__main__":
    main(sys.argv[1:])
