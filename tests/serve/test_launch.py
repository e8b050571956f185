"""rayllm.serve.launch: which `serve run` command lines it starts the local Ray for (without Ray's dashboard),
and which it leaves to `serve run`'s own ray.init. The launch itself runs in benchmarks/cold_start.py --mode make
(docs/benchmarks.md); no Ray starts here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rayllm.serve.launch import USAGE, starts_ray_here


def test_plain_serve_run_gets_ray_started_here():
    assert starts_ray_here(["cluster.yaml"], {})
    assert starts_ray_here(["--blocking", "-d", ".", "cluster.yaml"], {"RAYLLM_RAY_DASHBOARD": "0"})


@pytest.mark.parametrize("args", [["--address", "auto", "c.yaml"], ["-a", "ray://h:10001", "c.yaml"],
                                  ["--address=auto", "c.yaml"], ["--runtime-env", "env.yaml", "c.yaml"],
                                  ["--runtime-env-json={}", "c.yaml"], ["--working-dir", "/src", "c.yaml"]])
def test_options_that_reach_serve_runs_own_ray_init_leave_it_to_serve_run(args):
    assert not starts_ray_here(args, {})


@pytest.mark.parametrize("env", [{"RAY_ADDRESS": "127.0.0.1:6379"}, {"RAYLLM_RAY_DASHBOARD": "1"},
                                 {"RAYLLM_RAY_DASHBOARD": "true"}])
def test_an_existing_cluster_or_the_dashboard_leave_it_to_serve_run(env):
    assert not starts_ray_here(["cluster.yaml"], env)


def test_anything_but_serve_run_is_refused_before_ray_starts():
    out = subprocess.run([sys.executable, "-m", "rayllm.serve.launch", "serve", "deploy", "cluster.yaml"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and USAGE in out.stderr
