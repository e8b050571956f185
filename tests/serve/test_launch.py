"""rayllm.serve.launch: which `serve run` command lines it starts the local Ray for (without Ray's dashboard),
and which it leaves to `serve run`'s own ray.init. The launch itself runs in benchmarks/cold_start.py --mode make
(docs/benchmarks.md); no Ray starts here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rayllm.serve.launch import USAGE, starts_ray_here

NO_DASHBOARD = {"RAYLLM_RAY_DASHBOARD": "0"}


def test_without_the_dashboard_ray_is_started_here():
    assert starts_ray_here(["cluster.yaml"], NO_DASHBOARD)
    assert starts_ray_here(["--blocking", "-d", ".", "cluster.yaml"], {"RAYLLM_RAY_DASHBOARD": "false"})


def test_by_default_serve_run_starts_ray_with_its_dashboard():
    assert not starts_ray_here(["cluster.yaml"], {})


@pytest.mark.parametrize("args", [["--address", "auto", "c.yaml"], ["-a", "ray://h:10001", "c.yaml"],
                                  ["--address=auto", "c.yaml"], ["--runtime-env", "env.yaml", "c.yaml"],
                                  ["--runtime-env-json={}", "c.yaml"], ["--working-dir", "/src", "c.yaml"]])
def test_options_that_reach_serve_runs_own_ray_init_leave_it_to_serve_run(args):
    assert not starts_ray_here(args, NO_DASHBOARD)


@pytest.mark.parametrize("env", [{"RAY_ADDRESS": "127.0.0.1:6379", **NO_DASHBOARD}, {"RAYLLM_RAY_DASHBOARD": "1"},
                                 {"RAYLLM_RAY_DASHBOARD": "true"}])
def test_an_existing_cluster_or_the_dashboard_leave_it_to_serve_run(env):
    assert not starts_ray_here(["cluster.yaml"], env)


def test_anything_but_serve_run_is_refused_before_ray_starts():
    out = subprocess.run([sys.executable, "-m", "rayllm.serve.launch", "serve", "deploy", "cluster.yaml"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and USAGE in out.stderr
