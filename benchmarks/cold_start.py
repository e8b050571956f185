"""Cold start of the whole app, as `serve run cluster.yaml` does it, to the first streamed token.

    python benchmarks/cold_start.py [--rounds 2] [--mode api|cli|make|wake] [--wakes 2] [--trees DIR,DIR] [--model SOURCE]
                                    [--kv-cache-bytes N] [--plain-env]

Each round runs in a fresh process (fresh imports, a fresh Ray), then one streamed chat request.
--mode api (default): this process starts Ray and Serve and deploys build_app(cluster.yaml's args);
--mode wake: as api, with the model deployment at min_replicas 0: the time from a request to the sleeping
model to its first token, --wakes times per round;
--mode cli: the real `serve run` on a copy of cluster.yaml (its port and KV size changed), the
application built by Serve's own build task, as an operator starts it (`make serve`: with serving.env's
variables, HAProxy on ports of its own; --plain-env: without them).
--mode make: the command of the tree's own Makefile `serve` target (sourcing serving.env, as `make serve`
runs it; its venv's bin for $(BIN)) on a copy of cluster.yaml, with HAProxy on ports of its own.
--trees: source trees to alternate, round by round (e.g. a `git archive` of the baseline and this tree;
TREE@K=V+K=V runs that tree with those environment variables, e.g. RAYLLM_RAY_DASHBOARD=1);
another tree runs in a venv layered on this interpreter's site-packages with that tree first (Ray's workers
and the engine child run the driver's interpreter, with its working directory, the tree, first on sys.path).

Prints one JSON line per round and tree: wall seconds from the start to Ray up, to /health 200 and to
the first token; `timeline`: when each deployment's replica was added by Serve's controller, began and
finished its constructor, and was reported running (Serve's own logs); `ray` (cli and make modes): when the
local Ray's GCS, dashboard, raylet and driver, Serve's controller and the application's build began (their
logs), and `store_connect_s`, the raylet's wait to connect to its object store; and the model replica's `cold start`
record (rayllm.common.startup_phases.cold_start_record: download, engine child's imports, GGUF/config header,
load to device, KV cache, CUDA graphs, tokenizer, constructor, process age at the constructor's start).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LINE = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?-- (.*)$")
_EVENTS = {
    "added": re.compile(r"Adding \d+ replicas? to Deployment\(name='([^']+)'"),
    "running": re.compile(r"Replica\(id='[^']+', deployment='([^']+)', app='llm'\) started successfully"),
}


def _epoch(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()  # Ray logs local time


def timeline(session_dir: str, t0: float) -> dict[str, dict[str, float]]:
    """{deployment: {added, init_start, init_end, running}} in seconds since t0, from Serve's logs."""
    out: dict[str, dict[str, float]] = {}
    logs = os.path.join(session_dir, "logs", "serve")
    for path in glob.glob(os.path.join(logs, "controller_*.log")):
        for line in open(path, errors="replace"):
            m = _LINE.match(line)
            for name, pat in _EVENTS.items():
                e = pat.search(m.group(2)) if m else None
                if e and "app='llm'" in m.group(2):  # type: ignore[union-attr]
                    out.setdefault(e.group(1), {}).setdefault(name, round(_epoch(m.group(1)) - t0, 2))  # type: ignore[union-attr]
    for path in glob.glob(os.path.join(logs, "replica_llm_*.log")):
        dep = os.path.basename(path)[len("replica_llm_"):].rsplit("_", 1)[0]
        for line in open(path, errors="replace"):
            m = _LINE.match(line)
            if m and m.group(2).startswith(("Started initializing replica", "Finished initializing replica")):
                key = "init_start" if m.group(2).startswith("Started") else "init_end"
                out.setdefault(dep, {}).setdefault(key, round(_epoch(m.group(1)) - t0, 2))
    return out


_RAY_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_TEXT_LINE = re.compile(r"^(?:\w+ )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
_CONTROLLER = {"controller": "Controller starting", "deploy": "Deploying new app",
               "built": "Registering autoscaling state", "added": "Adding "}


def ray_timeline(session_dir: str, t0: float) -> dict[str, float]:
    """When the local Ray's processes and Serve's start-up steps began, in seconds since t0 (their logs)."""
    logs = os.path.join(session_dir, "logs")
    out: dict[str, float] = {}
    for key, name, pat in (("gcs", "gcs_server.out", _RAY_LINE), ("raylet", "raylet.out", _RAY_LINE),
                           ("dashboard", "dashboard.log", _TEXT_LINE)):
        try:
            with open(os.path.join(logs, name), errors="replace") as f:
                m = pat.match(f.readline())
        except OSError:
            continue
        if m:
            out[key] = round(_epoch(m.group(1)) - t0, 2)
    out["dashboard_modules"] = len(glob.glob(os.path.join(logs, "dashboard_*Head.log")))
    # The raylet's connect to its object store's socket: ~0 when the first try succeeds, else one retry
    # interval (Ray's default 1 s; serving.env's 0.1 s).
    marks: dict[str, float] = {}
    try:
        with open(os.path.join(logs, "raylet.out"), errors="replace") as f:
            for line in f:
                for key, text in (("store", "Plasma store debug dump"), ("objmgr", "ObjectManager server started")):
                    m = _RAY_LINE.match(line)
                    if m and key not in marks and text in line:
                        marks[key] = _epoch(m.group(1))
                if len(marks) == 2:
                    break
    except OSError:
        pass
    if len(marks) == 2:
        out["store_connect_s"] = round(marks["objmgr"] - marks["store"], 3)
    driver = glob.glob(os.path.join(logs, "python-core-driver-*.log"))
    if driver:
        m = _RAY_LINE.match(open(driver[0], errors="replace").readline())
        if m:
            out["driver"] = round(_epoch(m.group(1)) - t0, 2)
    for path in glob.glob(os.path.join(logs, "serve", "controller_[0-9]*.log")):
        for line in open(path, errors="replace"):
            m = _LINE.match(line)
            for key, text in _CONTROLLER.items():
                if m and key not in out and m.group(2).startswith(text):
                    out[key] = round(_epoch(m.group(1)) - t0, 2)
    return out


def wait_healthy(base: str, t0: float) -> None:
    """Poll /health every 50 ms with one client: a new httpx client per poll builds an SSL context each
    time (~20 ms of CPU), which took ~0.4 of a core from the starting app on two cores."""
    import httpx

    with httpx.Client(timeout=5) as client:
        while True:
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 300:
                raise TimeoutError("the app was not healthy within 300 s")
            time.sleep(0.05)


def first_token(base: str, t0: float) -> tuple[float, float]:
    """Poll /health until 200, then stream one chat request: (healthy, first token) seconds since t0."""
    import httpx

    wait_healthy(base, t0)
    healthy = time.time() - t0
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    return healthy, time.time() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(root: str, model: str | None, kv_cache_bytes: int) -> dict:
    import yaml

    with open(os.path.join(root, "cluster.yaml")) as f:
        config = yaml.safe_load(f)
    args = config["applications"][0]["args"]
    args["engine"]["cache"]["kv_cache_bytes"] = kv_cache_bytes
    if model:
        args["engine"]["model"]["model"] = model
    return config


def round_api(root: str, model: str | None, kv_cache_bytes: int) -> dict:
    t0 = time.time()
    import ray
    from ray import serve

    sys.path.insert(0, root)
    from rayllm.serve.builder import build_app

    os.environ.update(serving_env_of(root))
    t_import = time.time() - t0
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t_ray = time.time() - t0
    serve.run(build_app(app_args(root, model, kv_cache_bytes)["applications"][0]["args"]), name="llm",
              route_prefix="/", blocking=False)
    healthy, first = first_token(f"http://127.0.0.1:{port}", t0)
    record = serve.get_deployment_handle("llm", "llm").cold_start.remote().result()
    session = ray._private.worker._global_node.get_session_dir_path()
    serve.shutdown()
    ray.shutdown()
    return {"mode": "api", "imports_s": round(t_import, 2), "ray_up_s": round(t_ray, 2),
            "healthy_s": round(healthy, 2), "first_token_s": round(first, 2),
            "timeline": timeline(session, t0), "replica": _relative(record, t0)}


def round_wake(root: str, model: str | None, kv_cache_bytes: int, wakes: int) -> dict:
    """Scale to zero: the app with the model deployment at min_replicas 0 (cluster.yaml's autoscaling
    otherwise, the downscale delays cut to 2 s); each wake-up is the time from a streamed chat request to the
    sleeping model to its first token, once Ray holds no replica actor of the model."""
    import ray
    from ray import serve

    sys.path.insert(0, root)
    from rayllm.serve.builder import build_app

    os.environ.update(serving_env_of(root))
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = app_args(root, model, kv_cache_bytes)
    llm = next(d for d in config["applications"][0]["deployments"] if d["name"] == "llm")
    args = config["applications"][0]["args"]
    # docs/models-and-scaling.md's scale-to-zero settings (metrics_interval_s: 1, see there), the delays short.
    args["llm_deployment_options"] = {"autoscaling_config": llm["autoscaling_config"] | {
        "min_replicas": 0, "initial_replicas": 0, "upscale_delay_s": 0, "metrics_interval_s": 1,
        "downscale_delay_s": 2, "downscale_to_zero_delay_s": 2}}
    serve.run(build_app(args), name="llm", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, time.time())  # the ingress and tokenizer up, the model asleep
    out = []
    for _ in range(wakes):
        while [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::llm#llm#")]:
            time.sleep(0.2)
        time.sleep(1.0)  # the ingress's status read (at most 1 s old) sees the model asleep
        t0 = time.time()
        _, first = first_token(base, t0)
        record = serve.get_deployment_handle("llm", "llm").cold_start.remote().result()
        out.append({"wake_s": round(first, 2), "replica": _relative(record, t0)})
    serve.shutdown()
    ray.shutdown()
    return {"mode": "wake", "wakes": out}


def _relative(record: dict, t0: float) -> dict:
    if record.get("started_at"):
        record = dict(record, started_at=round(record["started_at"] - t0, 2))
    return record


def _session_of(pid: int) -> str:
    """The session dir of the local Ray that the `serve run` process `pid` started."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        m = re.search(r"--session-dir=(\S+)", " ".join(child.cmdline()))
        if m:
            return m.group(1)
    raise RuntimeError("the Ray cluster started by `serve run` was not found")


def _logged_record(session_dir: str) -> dict:
    """The model replica's `cold start` log line (logged at INFO, which round_cli sets)."""
    for path in glob.glob(os.path.join(session_dir, "logs", "serve", "replica_llm_llm_*.log")):
        for line in open(path, errors="replace"):
            if "cold start {" in line:
                return json.loads(line[line.index("cold start {") + len("cold start "):].strip())
    return {}


def serving_env_of(root: str) -> dict[str, str]:
    """What `make serve` exports before `serve run` (serving.env), with HAProxy ports of this run's own."""
    sys.path.insert(0, root)
    from rayllm.serve.serving_env import serving_env

    return serving_env() | {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}


def make_serve_command(root: str, config_path: str) -> str:
    """The tree's Makefile `serve` recipe as one shell line, on config_path, with this interpreter's bin."""
    makefile = open(os.path.join(root, "Makefile")).read()
    body = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0].split("\n")[1:]
    line = " ".join(part.strip().rstrip("\\").strip() for part in body if part.startswith("\t"))
    bin_dir = os.path.dirname(sys.executable)
    return line.replace("$(BIN)", bin_dir).replace("$$", "$").replace("cluster.yaml", config_path)


def round_cli(root: str, model: str | None, kv_cache_bytes: int, with_serving_env: bool = True,
              make: bool = False) -> dict:
    import yaml

    port = free_port()
    config = app_args(root, model, kv_cache_bytes)
    config["http_options"]["port"] = port
    # The replica's `cold start` line goes to its log, in the text form that timeline() reads.
    config["logging_config"].update(log_level="INFO", encoding="TEXT")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    ports = {"RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
    if make:  # the recipe sources serving.env itself
        env, cmd = dict(os.environ) | ports, ["bash", "-c", make_serve_command(root, f.name)]
    else:
        env, cmd = dict(os.environ) | (serving_env_of(root) if with_serving_env else {}), [serve_cli, "run", f.name]
    env.pop("RAY_ADDRESS", None)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        healthy, first = first_token(f"http://127.0.0.1:{port}", t0)
        session = _session_of(proc.pid)
        record = _logged_record(session)
    finally:
        proc.send_signal(signal.SIGINT)  # serve run tears the app and its local Ray down on Ctrl-C
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        os.unlink(f.name)
    return {"mode": "make" if make else "cli", "serving_env": with_serving_env or make, "healthy_s": round(healthy, 2),
            "first_token_s": round(first, 2), "timeline": timeline(session, t0), "ray": ray_timeline(session, t0),
            "replica": _relative(record, t0)}


def python_for(tree: str) -> str:
    """An interpreter that imports rayllm from `tree` (see --trees)."""
    if os.path.realpath(tree) == os.path.realpath(HERE):
        return sys.executable
    venv = os.path.join(tempfile.gettempdir(), "rayllm-bench-" + hashlib.sha1(os.path.realpath(tree).encode()).hexdigest()[:10])
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", venv], check=True)  # type: ignore[attr-defined]
        paths = [os.path.realpath(tree)] + [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
        site_dir = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
        with open(os.path.join(site_dir, "00-tree.pth"), "w") as f:
            f.write("\n".join(paths) + "\n")
        serve_cli = os.path.join(venv, "bin", "serve")
        with open(serve_cli, "w") as f:
            f.write(f"#!{py}\nimport sys\nfrom ray.serve.scripts import cli\nsys.exit(cli())\n")
        os.chmod(serve_cli, 0o755)
    return py


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mode", choices=("api", "cli", "make", "wake"), default="api")
    ap.add_argument("--wakes", type=int, default=2, help="--mode wake: wake-ups per round")
    ap.add_argument("--trees", default=HERE, help="comma-separated source trees, alternated each round")
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    ap.add_argument("--plain-env", action="store_true",
                    help="--mode cli: `serve run` without serving.env (make serve applies it)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a timeout still runs round_cli's clean-up
        if a.mode == "api":
            result = round_api(a.child, a.model, a.kv_cache_bytes)
        elif a.mode == "wake":
            result = round_wake(a.child, a.model, a.kv_cache_bytes, a.wakes)
        else:
            result = round_cli(a.child, a.model, a.kv_cache_bytes, not a.plain_env, make=a.mode == "make")
        print(json.dumps({"bench": "cold_start", "tree": a.child} | result), flush=True)
        return
    for r in range(a.rounds):
        for variant in a.trees.split(","):
            tree, _, env_spec = variant.partition("@")  # TREE@K=V+K=V: that tree with those variables
            env = os.environ | dict(kv.split("=", 1) for kv in env_spec.split("+") if kv)
            cmd = [python_for(tree), __file__, "--child", tree, "--mode", a.mode,
                   "--kv-cache-bytes", str(a.kv_cache_bytes), "--wakes", str(a.wakes)] + (["--model", a.model] if a.model else []) \
                + (["--plain-env"] if a.plain_env else [])
            # cwd too: Ray puts the driver's working directory on its workers' sys.path, first.
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tree, env=env)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            result = json.loads(lines[-1]) if lines else {"bench": "cold_start", "tree": tree, "error": out.stderr[-2000:]}
            print(json.dumps(result | {"round": r, "env": env_spec}), flush=True)


if __name__ == "__main__":
    main()
