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
