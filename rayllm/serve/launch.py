"""`make serve`'s launcher: `python -m rayllm.serve.launch serve run [serve run's options] cluster.yaml`.

Ray Serve's own `serve run`, unchanged (the same config, application build, Ctrl-C and exit). With
`RAYLLM_RAY_DASHBOARD=0` it first starts the local Ray that `serve run` would start with `ray.init()`'s
defaults, without Ray's dashboard: `ray.init` waits for the dashboard's web server and its module processes
before it starts the raylet, about 2 s of `make serve`'s cold start on two cores (docs/benchmarks.md). The
dashboard stays on by default because `serve status` / `serve config`, `ray list ...` and its web UI need it;
Ray's metrics agent (the `ray_vllm_*` exporter of docs/operations.md) runs either way. Where `serve run` would not start a local Ray (RAY_ADDRESS set, or `--address`) or would start it with
a runtime environment (`--runtime-env`, `--runtime-env-json`, `--working-dir`), it runs as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# serve run's options that reach its own ray.init: with any of them, serve run starts (or joins) Ray itself.
RAY_INIT_OPTIONS = ("--address", "-a", "--runtime-env", "--runtime-env-json", "--working-dir")
USAGE = "usage: python -m rayllm.serve.launch serve run [serve run's options] CONFIG_OR_IMPORT_PATH"


def starts_ray_here(run_args: list[str], environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this launcher starts the local Ray (without the dashboard: RAYLLM_RAY_DASHBOARD=0) before
    `serve run` gets run_args."""
    if environ.get("RAYLLM_RAY_DASHBOARD", "1").lower() not in ("0", "false", "no"):
        return False
    if environ.get("RAY_ADDRESS"):
        return False
    return not any(a == opt or a.startswith(opt + "=") for a in run_args for opt in RAY_INIT_OPTIONS)


def main(argv: list[str]) -> None:
    if argv[:2] != ["serve", "run"]:
        sys.exit(USAGE)
    if starts_ray_here(argv[2:]):
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE
        from ray.serve.scripts import parse_runtime_env_args

        # What serve run passes to ray.init when given no Ray options, plus include_dashboard=False.
        ray.init(address=None, namespace=SERVE_NAMESPACE, include_dashboard=False,
                 runtime_env=parse_runtime_env_args(runtime_env=None, runtime_env_json=None, working_dir=None))
    from ray.serve.scripts import cli

    cli.main(args=argv[1:], prog_name="serve")  # serve run skips its ray.init when Ray is up


if __name__ == "__main__":
    main(sys.argv[1:])
