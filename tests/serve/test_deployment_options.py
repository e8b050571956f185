"""A model deployment's Serve options (rayllm/serve/deployment_options.py), checked against Ray Serve's own
option handling: `Deployment.options` and the DeploymentConfig a replica reads. No Ray cluster is started."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve._private.config import DeploymentConfig

from rayllm.serve.builder import build_app, llm_deployment_options, model_config
from rayllm.serve.config import ServerConfig
from rayllm.serve.deployment_options import scaling_warnings
from rayllm.serve.llm_server import LLMDeployment

ROOT = Path(__file__).resolve().parents[2]


def served_options(args: dict) -> dict:
    config = ServerConfig.from_args(args)
    return llm_deployment_options(model_config(config, config.models[0]))


def test_a_models_ray_actor_options_keep_the_gpu_it_needs(gguf_path):
    """`ray_actor_options: {memory: ...}` adds to what the builder reserves: without num_gpus Ray sets no
    CUDA_VISIBLE_DEVICES and replicas share GPU 0."""
    options = served_options({"models": [{"engine": {"model": {"model": gguf_path}, "parallel": {"device": "cuda"}},
                                          "deployment": {"ray_actor_options": {"memory": 8 << 30}}}]})
    assert LLMDeployment.options(**options).ray_actor_options == {"num_cpus": 1, "num_gpus": 1, "memory": 8 << 30}
    # The server-wide options layer the same way, and a value named again wins.
    options = served_options({"engine": {"model": {"model": gguf_path}, "parallel": {"device": "cuda"}},
                              "llm_deployment_options": {"ray_actor_options": {"num_cpus": 3}}})
    assert options["ray_actor_options"] == {"num_cpus": 3, "num_gpus": 1}


def test_autoscaling_without_a_target_scales_at_three_quarters_of_the_batch(gguf_path):
    engine = {"model": {"model": gguf_path}, "scheduler": {"max_num_seqs": 64}, "parallel": {"device": "cpu"}}
    options = served_options({"models": [{"engine": engine,
                                          "deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}}]})
    scaling = LLMDeployment.options(**options)._deployment_config.autoscaling_config
    assert (scaling.target_ongoing_requests, scaling.min_replicas, scaling.max_replicas) == (48, 1, 4)
    # Serve's own default, which the builder no longer leaves in place: a replica per 2 requests.
    bare = LLMDeployment.options(autoscaling_config={"min_replicas": 1, "max_replicas": 4})
    assert bare._deployment_config.autoscaling_config.target_ongoing_requests == 2


def test_a_target_no_replica_can_reach_is_refused_when_the_app_is_built(gguf_path):
    args = {"engine": {"model": {"model": gguf_path}, "parallel": {"device": "cpu"}},
            "llm_deployment_options": {"max_ongoing_requests": 8,
                                       "autoscaling_config": {"min_replicas": 1, "max_replicas": 2,
                                                              "target_ongoing_requests": 64}}}
    # Serve itself takes it (and would never scale up) ...
    LLMDeployment.options(**args["llm_deployment_options"])
    # ... the builder does not.
    with pytest.raises(ValueError, match=r"deployment\.autoscaling_config\.target_ongoing_requests \(64\) is above "
                                         r"max_ongoing_requests \(8\)"):
        build_app(args)


def merged_llm_config(path: str) -> tuple[DeploymentConfig, int]:
    """The llm deployment's config as Serve merges a config file's `deployments` section, and max_num_seqs."""
    (app,) = yaml.safe_load((ROOT / path).read_text())["applications"]
    (llm,) = [d for d in app["deployments"] if d["name"] == "llm"]
    fields = {k: v for k, v in llm.items() if k in DeploymentConfig.model_fields}
    return DeploymentConfig.from_default(**fields), app["args"]["engine"]["scheduler"]["max_num_seqs"]


@pytest.mark.parametrize("path", ["cluster.yaml", "deploy/cluster-gpu.yaml"])
def test_the_shipped_scaling_draws_no_warning_and_serves_default_does(path):
    config, max_num_seqs = merged_llm_config(path)
    assert scaling_warnings(config, max_num_seqs) == []
    # The same section without a target (Serve's default of 2 then applies), or with one above the queue.
    untargeted = DeploymentConfig.from_default(max_ongoing_requests=config.max_ongoing_requests,
                                               autoscaling_config={"min_replicas": 1, "max_replicas": 4})
    (warning,) = scaling_warnings(untargeted, max_num_seqs)
    assert "is 2 (Serve's default when none is set)" in warning
    unreachable = DeploymentConfig.from_default(max_ongoing_requests=8, autoscaling_config={
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16})
    (warning,) = scaling_warnings(unreachable, max_num_seqs)
    assert "never scales up" in warning
