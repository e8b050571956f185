"""What KubeRay v1.7.0 (the release whose CRD deploy/kuberay vendors) and Ray 2.60 do with the pods of both
RayService manifests, each rule from their source:

- KubeRay submits serveConfigV2 only once the head pod is Ready (rayservice_controller.go, reconcileServe) and
  gives a Ray container its own probes only when it has none (common/pod.go, initLivenessAndReadinessProbe).
- KubeRay's dashboard client sends the Ray token only when rayClusterConfig.authOptions.mode is token
  (utils/util.go, GetRayDashboardClientFunc); with it KubeRay sets RAY_AUTH_MODE / RAY_AUTH_TOKEN in every Ray
  container, init container and the autoscaler sidecar, each only where the container has none
  (common/pod.go, SetContainerTokenAuthEnvVars); token mode needs rayVersion 2.52.0 or later (utils/validation.go).
- serviceUnhealthySecondThreshold and deploymentUnhealthySecondThreshold are "Deprecated: This field is not used
  anymore" (apis/ray/v1/rayservice_types.go); rayClusterDeletionDelaySeconds (default 60) is how long an old
  cluster stays after an upgrade moved the traffic (rayservice_controller.go, cleanUpRayClusterInstance).
- Ray's `ray start` drains its node on SIGTERM for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, then stops its
  processes (ray/_private/node.py); Serve stops a draining node's replica by the drain deadline minus its
  graceful_shutdown_timeout_s (ray/serve/_private/deployment_state.py); the kubelet kills the pod after its
  terminationGracePeriodSeconds (default 30).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rayllm.serve.builder import with_resolved_device
from rayllm.serve.config import ServerConfig
from tests.deploy.test_deploy import node_resources, schema_errors

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ["rayservice.yaml", "rayservice-gpu.yaml"]
KUBERNETES_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it names none


def manifest(name: str, text: str | None = None) -> dict:
    return yaml.safe_load(text if text is not None else (ROOT / "deploy" / name).read_text())


def pods(doc: dict) -> list[tuple[dict, dict]]:
    """(pod spec, Ray container) of the head and of every worker group."""
    ray_cluster = doc["spec"]["rayClusterConfig"]
    out = []
    for group in [ray_cluster["headGroupSpec"], *ray_cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        out.append((spec, spec["containers"][0]))  # KubeRay's Ray container is the first (utils.RayContainerIndex)
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def app_args(doc: dict) -> dict:
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    return app["args"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_no_ray_container_sets_its_own_readiness_probe(name):
    """A readinessProbe on the head's Serve port would keep the head unready until Serve answers, and KubeRay
    submits the Serve config (which starts Serve) only to a Ready head: the RayService never comes up; later a
    503 from /health would drop the head from the Service and stop config updates. KubeRay's own probes (Ray's
    health; on workers also the Serve proxy's) apply only to a container without one."""
    for _, container in pods(manifest(name)):
        assert "readinessProbe" not in container, container["name"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_token_auth_goes_through_kuberays_auth_options(name):
    doc = manifest(name)
    ray_cluster = doc["spec"]["rayClusterConfig"]
    auth = ray_cluster["authOptions"]
    assert auth["mode"] == "token"
    version = tuple(int(p) for p in ray_cluster["rayVersion"].split("."))
    assert version >= (2, 52, 0)
    # The secret the file's header creates, with the key KubeRay reads (utils.RAY_AUTH_TOKEN_SECRET_KEY).
    created = re.findall(r"kubectl create secret generic (\S+) --from-literal=auth_token=",
                         (ROOT / "deploy" / name).read_text())
    assert created == [auth["secretName"]]
    # Hand-written ones would stand in for KubeRay's (it adds each only where missing).
    for _, container in pods(doc):
        assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(env_of(container)), container["name"]
    assert schema_errors(doc) == []


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_app_built_before_a_gpu_worker_joined_runs_on_cuda(name):
    """KubeRay submits the Serve config once the head is Ready; the builder resolves `device: auto` then, once,
    from the cluster's resources, which may be the head's alone (no GPU): the model must still go to CUDA."""
    doc = manifest(name)
    ray_cluster = doc["spec"]["rayClusterConfig"]
    assert all(node_resources(g)["GPU"] > 0 for g in ray_cluster["workerGroupSpecs"])  # GPU workers only
    head_alone = node_resources(ray_cluster["headGroupSpec"])
    assert head_alone["GPU"] == 0
    config = with_resolved_device(ServerConfig.from_args(app_args(doc)), head_alone)
    assert [m.engine.parallel.device for m in config.models] == ["cuda"] * len(config.models)


@pytest.mark.parametrize("name", MANIFESTS)
def test_pods_outlast_the_drain(name):
    """The drain bound, graceful_shutdown_timeout_s, holds on Kubernetes too: an old cluster keeps its open
    streams at least that long after an upgrade, and a deleted pod's Ray drains at least that long (so Serve
    can stop its replicas gracefully) and ends before the kubelet's SIGKILL."""
    from ray._private import ray_constants

    doc = manifest(name)
    spec = doc["spec"]
    assert not {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} & set(spec)
    (app,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    drain_s = max(d.get("graceful_shutdown_timeout_s", 0) for d in app["deployments"])
    assert drain_s == 60
    assert spec["rayClusterDeletionDelaySeconds"] >= drain_s
    for pod, container in pods(doc):
        env = env_of(container)
        ray_drain_s = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]["value"]) \
            if "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" in env else ray_constants.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
        assert ray_drain_s > drain_s, container["name"]
        assert pod.get("terminationGracePeriodSeconds", KUBERNETES_GRACE_S) > ray_drain_s, container["name"]
    assert schema_errors(doc) == []


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_commented_storage_url_is_a_secret_env_the_config_reads(name, monkeypatch):
    """storage_url null is SQLite on the pod's disk; the manifests show, commented out in every Ray container
    (the app is built on the head, its replicas run on any pod), STORAGE_URL from a secret. Uncommented, it
    passes KubeRay's schema, and the config reader takes a postgresql:// URL from it."""
    text = (ROOT / "deploy" / name).read_text()
    uncommented, count = re.subn(r"(?m)^(\s*)# (- name: STORAGE_URL)\b.*\n\1#   (valueFrom: .*)$", r"\1\2\n\1  \3", text)
    doc = manifest(name, uncommented)
    assert count == len(pods(doc))
    for _, container in pods(doc):
        assert env_of(container)["STORAGE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "url"
    assert schema_errors(doc) == []
    args = app_args(doc)
    assert args["storage_url"] is None
    monkeypatch.setenv("STORAGE_URL", "postgresql://rayllm:secret@db:5432/rayllm")
    assert ServerConfig.from_args(dict(args)).storage_url == "postgresql://rayllm:secret@db:5432/rayllm"


def test_every_pod_of_the_gated_model_reads_hf_token():
    """Llama 3.1 is a gated Hugging Face repo: the head, where Serve builds the app (which reads the model's
    config), needs HF_TOKEN as much as the workers that fetch the weights."""
    doc = manifest("rayservice-gpu.yaml")
    assert app_args(doc)["engine"]["model"]["model"].startswith("meta-llama/")
    for _, container in pods(doc):
        ref = env_of(container)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("rayllm-tp-hf-token", "token"), container["name"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_api_on_all_interfaces_answers_only_keys_from_a_required_secret(name, monkeypatch):
    """The pods listen on 0.0.0.0: every Ray container (the app is built on any pod) reads API_KEYS from a
    secret that is not optional (without it the pod does not start, rather than serving an open API), and the
    config reader turns it into the app's keys."""
    doc = manifest(name)
    assert yaml.safe_load(doc["spec"]["serveConfigV2"])["http_options"]["host"] == "0.0.0.0"
    for _, container in pods(doc):
        ref = env_of(container)["API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref.get("optional", False)) == ("rayllm-tp-api-keys", "keys", False)
    args = app_args(doc)
    assert args["api_keys"] == []
    monkeypatch.setenv("API_KEYS", "sk-one,sha256:" + "ab" * 32)
    assert len(ServerConfig.from_args(dict(args)).api_keys) == 2
