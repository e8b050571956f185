"""build_app(args) -> the Serve application: ingress -> tokenizer, ingress -> llm (TP actors per replica).

Used as `import_path: deployments.builder:build_app` in cluster.yaml, so `serve run cluster.yaml`
and `serve run deployments.builder:build_app engine='{...}'` both work.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve import Application

from deployments.config import ServerConfig
from deployments.ingress import Ingress
from deployments.llm_server import LLMDeployment
from deployments.tokenizer import TokenizerDeployment
from model_parallel.model_files import resolve_model_path
from model_parallel.worker import resolve_device

log = logging.getLogger("ray.serve")


def placement_bundles(config: ServerConfig) -> list[dict[str, float]] | None:
    """Bundle 0 holds the replica itself; one more bundle per tensor-parallel rank."""
    tp = config.engine.parallel.tensor_parallel_size
    if tp == 1 and config.engine.parallel.executor == "auto":
        return None  # the replica runs the model in-process
    on_gpu = resolve_device(config.engine.parallel.device).type == "cuda"
    rank = {"CPU": 1.0, "GPU": 1.0} if on_gpu else {"CPU": 1.0}
    return [{"CPU": config.replica_num_cpus}] + [rank] * tp


def serving_nice(config: ServerConfig) -> int:
    """Only a CPU engine competes with the serving processes for cores."""
    return config.serving_nice if resolve_device(config.engine.parallel.device).type == "cpu" else 0


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application-builder entry: exactly one parameter, the `args` mapping from cluster.yaml."""
    return build_app_with(ServerConfig.from_args(args))


def build_app_with(config: ServerConfig, engine_cls=None, llm_options: dict[str, Any] | None = None) -> Application:
    """The same, from a config object; `engine_cls` lets routing tests inject a small fake engine, and
    `llm_options` adds Serve options to the model deployment (tests: num_replicas)."""
    model_path = resolve_model_path(config.engine.model.model)
    llm_options = {"ray_actor_options": {"num_cpus": config.replica_num_cpus}} | (llm_options or {})
    bundles = placement_bundles(config)
    if bundles:
        llm_options |= {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
    llm_options |= config.llm_deployment_options  # queue bounds, autoscaling, drain (cluster.yaml overrides)
    nice = serving_nice(config)
    llm = LLMDeployment.options(**llm_options).bind(config.engine, model_path, engine_cls, config.stream_interval_s,
                                                    config.engine_process, nice)
    tokenizer = TokenizerDeployment.options(ray_actor_options={"num_cpus": 0}).bind(model_path, nice)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(config, tokenizer, llm, nice)
