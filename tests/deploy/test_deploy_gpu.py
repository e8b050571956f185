"""The GPU KubeRay manifest (deploy/rayservice-gpu.yaml): it embeds deploy/cluster-gpu.yaml, passes KubeRay's
CRD schema, and its GPU pods hold the model replicas (one GPU each) at the worker group's smallest and
largest size; the TP=2 variant needs pods of two GPUs. The helpers are tests/deploy/test_deploy.py's."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.deploy.test_deploy import cluster_nodes, replica_demands, schema_errors, unplaced

ROOT = Path(__file__).resolve().parents[2]


def gpu_manifest() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "rayservice-gpu.yaml").read_text())


def test_gpu_rayservice_embeds_cluster_gpu_yaml():
    doc = gpu_manifest()
    embedded = yaml.safe_load(doc["spec"]["serveConfigV2"])
    source = yaml.safe_load((ROOT / "deploy" / "cluster-gpu.yaml").read_text())
    assert embedded["http_options"].pop("host") == "0.0.0.0"  # pods listen on all interfaces
    source["http_options"].pop("host")
    assert embedded == source
    cpu = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == cpu["spec"]["rayClusterConfig"]["rayVersion"]
    assert schema_errors(doc) == []


def test_gpu_rayservice_pods_hold_the_model_replicas():
    manifest = gpu_manifest()
    assert unplaced(manifest, "min") == [] and unplaced(manifest, "max") == []
    (workers,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus = sum(n["GPU"] for n in cluster_nodes(manifest, "maxReplicas"))
    llm = [need for name, need in replica_demands(manifest, cluster_nodes(manifest, "maxReplicas"), "max")
           if name == "llm"]
    assert len(llm) == gpus == workers["maxReplicas"] and all(need["GPU"] == 1 for need in llm)

    # The TP=2 variant's replicas need two GPUs on one node: not on these pods, but on pods of two GPUs.
    wide = yaml.safe_load(yaml.safe_dump(manifest))
    wide["spec"]["serveConfigV2"] = (ROOT / "deploy" / "cluster-gpu-tp2.yaml").read_text()
    assert set(unplaced(wide, "min")) == {"llm"}
    limits = wide["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    limits["limits"] |= {"nvidia.com/gpu": "2", "cpu": "16"}
    wide["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = 4
    assert unplaced(wide, "min") == [] and unplaced(wide, "max") == []
