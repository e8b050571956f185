"""The Ray processes' environment for serving, read from `serving.env` at the repository root.

Ray and Ray Serve read these variables when their processes start, so they cannot live in cluster.yaml:
`make serve` sources the file, deploy/rayservice.yaml repeats it in each container, and code that starts
Ray itself (the serve tests, the benchmarks) applies `serving_env()` to its environment first.
"""

from __future__ import annotations

from pathlib import Path

SERVING_ENV = Path(__file__).resolve().parents[2] / "serving.env"


def serving_env(path: Path = SERVING_ENV) -> dict[str, str]:
    """KEY=VALUE lines of the file; blank lines and `#` comments skipped."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{path}: not a KEY=VALUE line: {raw!r}")
        env[key.strip()] = value.strip()
    return env
