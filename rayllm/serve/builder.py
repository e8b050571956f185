"""build_app(args) -> the Serve application: ingress -> tokenizer, ingress -> llm (TP actors per replica).

Used as `import_path: rayllm.serve.builder:build_app` in cluster.yaml, so `serve run cluster.yaml`
and `serve run rayllm.serve.builder:build_app engine='{...}'` both work.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from ray.serve import Application

from rayllm.loader import model_sources
from rayllm.loader.model_files import resolve_model_path
from rayllm.schema.config import cpu_only_settings, for_device
from rayllm.serve.config import ModelEntry, ServerConfig, deployment_name
from rayllm.serve.deployment_options import layered, with_autoscaling_checked
from rayllm.serve.ingress import Ingress
from rayllm.serve.llm_server import LLMDeployment
from rayllm.serve.prefix_router import request_router_config
from rayllm.serve.serving_priority import ServingPriority
from rayllm.serve.tokenizer import TokenizerDeployment

log = logging.getLogger("ray.serve")


def cluster_resources() -> dict[str, float]:
    """The Ray cluster's total resources; outside a Ray session, this machine's GPUs."""
    import ray

    if ray.is_initialized():
        return dict(ray.cluster_resources())
    import torch

    return {"GPU": float(torch.cuda.device_count())}


def resolve_device(choice: str, resources: Mapping[str, float] | None = None) -> str:
    """`device: auto` decided once, here, from the cluster's resources: cuda when it has GPUs.

    A cluster that adds GPU nodes only on demand (an autoscaler with no GPU worker up yet) reports
    none; name `device: cuda` there, which makes every replica ask for a GPU and so scales them up.
    """
    if choice != "auto":
        return choice
    resources = cluster_resources() if resources is None else resources
    return "cuda" if resources.get("GPU", 0) > 0 else "cpu"


def with_resolved_device(config: ServerConfig, resources: Mapping[str, float] | None = None) -> ServerConfig:
    """The config with every model's `parallel.device` resolved, and the settings whose `auto` depends on it
    (cache.block_size: schema.config.for_device), so replicas and workers never re-decide."""
    def resolved(entry: ModelEntry) -> ModelEntry:
        engine = for_device(entry.engine, resolve_device(entry.engine.parallel.device, resources))
        return entry if engine is entry.engine else dataclasses.replace(entry, engine=engine)

    models = tuple(resolved(m) for m in config.models)
    return config if models == config.models else dataclasses.replace(config, engine=models[0].engine, models=models)


def model_config(config: ServerConfig, entry: ModelEntry) -> ServerConfig:
    """The server config as one model's deployment sees it (its engine; the server-wide rest)."""
    return dataclasses.replace(config, engine=entry.engine, models=(entry,))


def largest_node(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """The alive node of `ray.nodes()` with the most CPUs (its resources)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", True))]
    return max(alive, key=lambda r: (r.get("GPU", 0.0), r.get("CPU", 0.0)), default={})


def check_fits_one_node(config: ServerConfig, nodes: list[dict[str, Any]]) -> None:
    """A replica's bundles are packed on one node (no pipeline parallelism yet): refuse a tensor-parallel
    size that no node of the cluster can hold, rather than leave the replica pending forever."""
    bundles = placement_bundles(config)
    if not bundles or not nodes:
        return
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            need[key] = need.get(key, 0.0) + value
    fits = [n for n in nodes if n.get("Alive", True)
            and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in need.items())]
    if not fits:
        big = largest_node(nodes)
        tp = config.engine.parallel.tensor_parallel_size
        raise ValueError(
            f"model {config.served_model_name!r}: tensor_parallel_size {tp} needs "
            + ", ".join(f"{v:g} {k}" for k, v in sorted(need.items()))
            + " on one node (a replica's ranks share a node), but the largest node has "
            + (", ".join(f"{big.get(k, 0.0):g} {k}" for k in sorted(need)) or "nothing")
            + "; lower tensor_parallel_size or add a bigger node")


def _on_gpu(config: ServerConfig) -> bool:
    return resolve_device(config.engine.parallel.device) == "cuda"


def engine_in_replica(config: ServerConfig) -> bool:
    """TP=1 with the default executor runs the model in the replica (or its child process)."""
    parallel = config.engine.parallel
    return parallel.tensor_parallel_size == 1 and parallel.executor == "auto"


def replica_actor_options(config: ServerConfig) -> dict[str, float]:
    """The model replica's own reservation. When it runs the model itself on CUDA it reserves the GPU,
    so Ray sets its CUDA_VISIBLE_DEVICES (inherited by the engine's child process) and no two replicas
    share a GPU."""
    options = {"num_cpus": config.replica_num_cpus}
    if engine_in_replica(config) and _on_gpu(config):
        options["num_gpus"] = 1
    return options


def placement_bundles(config: ServerConfig) -> list[dict[str, float]] | None:
    """Bundle 0 holds the replica itself; one more bundle per tensor-parallel rank, each with its GPU."""
    if engine_in_replica(config):
        return None  # the replica runs the model in-process; replica_actor_options reserves its GPU
    rank = {"CPU": 1.0, "GPU": 1.0} if _on_gpu(config) else {"CPU": 1.0}
    return [{"CPU": config.replica_num_cpus}] + [rank] * config.engine.parallel.tensor_parallel_size


def ignored_on_gpu(config: ServerConfig) -> list[str]:
    """The CPU-only settings of a resolved config that a GPU app ignores (cluster.yaml's CPU tuning)."""
    names = {name for entry in config.models if entry.engine.parallel.device == "cuda"
             for name in cpu_only_settings(entry.engine)}
    if config.serving_nice not in (0, "auto") and all(entry.engine.parallel.device == "cuda" for entry in config.models):
        names.add(f"serving_nice ({config.serving_nice})")
    return sorted(names)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application-builder entry: exactly one parameter, the `args` mapping from cluster.yaml."""
    return build_app_with(ServerConfig.from_args(args))


def llm_deployment_options(config: ServerConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve options of the (first) model's deployment for a config whose device is resolved: placement,
    then `extra`, the server-wide llm_deployment_options, and the model's own `deployment` options."""
    options = layered({"ray_actor_options": replica_actor_options(config)}, extra or {})
    bundles = placement_bundles(config)
    if bundles:
        options |= {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}
    cache = config.engine.cache
    if config.router.policy == "prefix" and cache.enable_prefix_caching:  # no cache: nothing to be near
        options["request_router_config"] = request_router_config(config.router, cache.block_size)
    # queue bounds, autoscaling, drain (cluster.yaml's `deployments` section overrides all of these)
    options = layered(options, config.llm_deployment_options, config.models[0].deployment)
    return with_autoscaling_checked(options, max_num_seqs=config.engine.scheduler.max_num_seqs,
                                    default_max_ongoing=LLMDeployment.max_ongoing_requests,
                                    where=f"model {config.served_model_name!r}: deployment")


def checked_source(entry: ModelEntry) -> tuple[ModelEntry, str]:
    """The model's source checked here, where the app is built (Serve's build task on the head node): a
    missing, private or gated model fails the deploy, naming it, yet no weights are fetched (config and
    tokenizer files at most). A remote source is pinned (a Hugging Face id to the commit its revision names
    now) in the entry and in the path its deployments get, so that every replica, engine and tokenizer fetches
    the same files to its own node's cache however the repository moves meanwhile; a local path is resolved."""
    model = entry.engine.model
    if not model_sources.is_remote(model.model):
        return entry, resolve_model_path(model.model, model.revision)
    pinned = model_sources.check(model.model, model.revision)
    engine = dataclasses.replace(entry.engine, model=dataclasses.replace(model, model=pinned, revision=None))
    return dataclasses.replace(entry, engine=engine), pinned


def build_app_with(config: ServerConfig, llm_options: dict[str, Any] | None = None) -> Application:
    """The same, from a config object; `llm_options` adds Serve options to every model deployment (tests:
    num_replicas)."""
    import ray

    config = with_resolved_device(config)
    ignored = ignored_on_gpu(config)
    if ignored:  # one line per app: cluster.yaml's CPU tuning is harmless on a GPU, but not silently dropped
        log.info("device cuda: ignoring the CPU-only settings %s", ", ".join(ignored))
    nodes = ray.nodes() if ray.is_initialized() else []
    priority = ServingPriority.of(config)  # the ingress derives the same from its config
    llms: dict[str, Any] = {}
    paths: dict[str, str] = {}
    entries: list[ModelEntry] = []
    for index, entry in enumerate(config.models):
        check_fits_one_node(model_config(config, entry), nodes)
        entry, path = checked_source(entry)
        paths[entry.name] = path
        entries.append(entry)
        one = model_config(config, entry)
        options = llm_deployment_options(one, llm_options) | {"name": deployment_name(index, entry)}
        llms[entry.name] = LLMDeployment.options(**options).bind(
            entry.engine, path, config.stream_interval_s, config.engine_process,
            ServingPriority.of(one), config.tracing, grammar_compile_timeout_s=config.grammar_compile_timeout_s)
    if tuple(entries) != config.models:  # the ingress sees the pinned sources too
        config = dataclasses.replace(config, engine=entries[0].engine, models=tuple(entries))
    tokenizer = TokenizerDeployment.options(ray_actor_options={"num_cpus": 0}).bind(paths, priority, config.tracing)
    # Model deployments first (keywords, in this order): Serve deploys and starts replicas in the order it finds
    # them here, and the first start takes the worker process Ray has idle, which the slowest replica needs most.
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(config, llms=llms, tokenizer=tokenizer)
