"""The GPU configurations, checked on a CPU machine: deploy/cluster-gpu.yaml and its TP=2 variant are valid
Serve configs that our config loader accepts, and cluster.yaml run on a GPU machine takes the GPU defaults
(block size) and ignores its CPU-only settings with one log line.

CUDA cannot run here: where a test needs "a machine with a GPU", what the builder and the engine ask before
any worker starts is mocked: the builder's `cluster_resources` (Ray's resources, or torch's device count
outside Ray) and `torch.cuda.is_available`. The builder and the deployment options are the real ones; no
Ray cluster is started (the app is only built and bound).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from rayllm.schema.config import AUTO_BLOCK_SIZE, CpuConfig, EngineConfig, for_device
from rayllm.serve.builder import build_app, llm_deployment_options, model_config, with_resolved_device
from rayllm.serve.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIGS = ["deploy/cluster-gpu.yaml", "deploy/cluster-gpu-tp2.yaml"]


def app_of(path: str) -> dict:
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / path).read_text())
    ServeDeploySchema.model_validate(doc)  # what `serve run` / KubeRay check first
    (app,) = doc["applications"]
    assert app["import_path"] == "rayllm.serve.builder:build_app"
    return app


def bound_llm(app):
    """The model deployment bound into a built app (the ingress holds the models as a dict)."""
    ingress = app._bound_deployment
    bound = [*ingress.init_args, *ingress.init_kwargs.values()]
    args = [v for a in bound for v in (a.values() if isinstance(a, dict) else [a])]
    return next(a for a in args if getattr(a, "_bound_deployment", None) is not None
                and a._bound_deployment.name == "llm")._bound_deployment


@pytest.mark.parametrize("path", GPU_CONFIGS)
def test_gpu_configs_load_and_reserve_gpus(path):
    app = app_of(path)
    config = ServerConfig.from_args(app["args"])
    engine = config.engine
    assert engine.parallel.device == "cuda" and engine.parallel.cuda_graphs
    assert engine.cache.block_size == 64 and engine.scheduler.max_num_seqs == 256
    assert engine.scheduler.max_num_batched_tokens == 8192 and engine.model.max_model_len >= 32768
    assert engine.parallel.cpu == CpuConfig() and config.serving_nice == 0  # no CPU tuning
    # What the builder reserves per replica (the Serve config's `deployments` override it: they must agree).
    options = llm_deployment_options(model_config(config, config.models[0]))
    (llm,) = [d for d in app["deployments"] if d["name"] == "llm"]
    tp = engine.parallel.tensor_parallel_size
    if tp == 1:
        assert options["ray_actor_options"] == llm["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    else:  # the replica's CPUs, then one GPU per rank, on one node
        assert "ray_actor_options" not in llm and options["placement_group_strategy"] == "STRICT_PACK"
        assert options["placement_group_bundles"] == [{"CPU": 2}] + [{"CPU": 1.0, "GPU": 1.0}] * tp
    assert llm["autoscaling_config"]["max_replicas"] * tp == 8  # replicas scale up to 8 GPUs either way


def test_tp2_variant_differs_only_where_tensor_parallelism_does():
    one, two = (app_of(p) for p in GPU_CONFIGS)
    differs = {("engine", "model", "model"), ("engine", "model", "served_model_name"),
               ("engine", "model", "max_model_len"), ("engine", "parallel", "tensor_parallel_size"),
               ("wake_timeout_s",)}

    def flat(d: dict, prefix: tuple = ()) -> dict:
        return {k: v for key, value in d.items()
                for k, v in (flat(value, prefix + (key,)) if isinstance(value, dict) and value else
                             {prefix + (key,): value}).items()}

    a, b = flat(one["args"]), flat(two["args"])
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == differs
    deployments = [{d["name"]: d for d in app["deployments"]} for app in (one, two)]
    deployments[0]["llm"].pop("ray_actor_options")
    deployments[0]["llm"]["autoscaling_config"].pop("max_replicas")
    deployments[1]["llm"]["autoscaling_config"].pop("max_replicas")
    assert deployments[0] == deployments[1]


def shipped_args() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())["applications"][0]["args"]


def test_cluster_yaml_on_a_gpu_machine_takes_gpu_defaults_and_says_what_it_ignores(monkeypatch, caplog):
    """cluster.yaml as shipped, built on a cluster with one GPU (mocked): the engine config bound into the
    model deployment says cuda and block size 64, the replica reserves the GPU, the serving processes keep
    their priority, and one log line names the CPU settings left unused."""
    from rayllm.serve import builder

    monkeypatch.setattr(builder, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        llm = bound_llm(build_app(shipped_args()))
    engine, nice = llm.init_args[0], llm.init_args[4].nice
    assert engine.parallel.device == "cuda" and engine.cache.block_size == AUTO_BLOCK_SIZE["cuda"] == 64
    assert llm.ray_actor_options["num_gpus"] == 1 and nice == 0
    lines = [r.getMessage() for r in caplog.records if "CPU-only settings" in r.getMessage()]
    assert lines == ["device cuda: ignoring the CPU-only settings engine.parallel.cpu"]  # serving_nice: auto
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        llm = bound_llm(build_app(shipped_args() | {"serving_nice": 10}))  # a value set for a CPU is named
    assert llm.init_args[4].nice == 0
    lines = [r.getMessage() for r in caplog.records if "CPU-only settings" in r.getMessage()]
    assert lines == ["device cuda: ignoring the CPU-only settings engine.parallel.cpu, serving_nice (10)"]

    # The same file on this CPU machine: the CPU defaults, the CPU tuning in force, no such line.
    monkeypatch.setattr(builder, "cluster_resources", lambda: {"CPU": 16.0})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        llm = bound_llm(build_app(shipped_args()))
    engine, nice = llm.init_args[0], llm.init_args[4].nice
    assert engine.parallel.device == "cpu" and engine.cache.block_size == 16 and nice == 10
    assert engine.parallel.cpu.threads_per_rank == 1 and "num_gpus" not in llm.ray_actor_options
    assert not [r for r in caplog.records if "CPU-only settings" in r.getMessage()]


def test_auto_block_size_follows_the_device_and_a_set_value_stays():
    auto = EngineConfig()
    assert auto.cache.block_size == "auto"
    assert for_device(auto, "cuda").cache.block_size == 64 and for_device(auto, "cpu").cache.block_size == 16
    fixed = EngineConfig.from_dict({"cache": {"block_size": 32}})
    assert for_device(fixed, "cuda").cache.block_size == 32
    once = for_device(auto, "cuda")
    assert for_device(once, "cuda") is once  # idempotent: replicas and workers never re-decide
    resolved = with_resolved_device(ServerConfig(), {"GPU": 2.0})
    assert resolved.engine.parallel.device == "cuda" and resolved.engine.cache.block_size == 64
    with pytest.raises(ValueError, match="block_size must be auto or a power of two"):
        EngineConfig.from_dict({"cache": {"block_size": "big"}})


def test_engine_alone_resolves_auto_on_a_gpu_machine(monkeypatch):
    """An engine started outside Serve (benchmarks, tests) decides on this machine: with CUDA (mocked)
    the same defaults as the builder's."""
    from rayllm.executor.executor import resolve_local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = resolve_local_device(EngineConfig())
    assert config.parallel.device == "cuda" and config.cache.block_size == 64
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_local_device(EngineConfig()).cache.block_size == 16


def test_the_device_scripts_serve_config_loads_and_fits_one_gpu():
    """tests/gpu/serve_device.sh serves deploy/cluster-gpu.yaml with its three random models on one GPU: the
    config it writes there is valid, and its three model replicas together reserve that one GPU."""
    from ray.serve.schema import ServeDeploySchema

    from rayllm.serve.builder import deployment_name
    from tests.gpu.serve_device_models import BIG, FAULTS, TINY, serve_config

    doc = serve_config(Path("/tmp/models"))
    ServeDeploySchema.model_validate(doc)
    (app,) = doc["applications"]
    config = ServerConfig.from_args(app["args"])
    assert [m.name for m in config.models] == [BIG, TINY, FAULTS]
    big, tiny, faults = (m.engine for m in config.models)
    assert faults.debug.fail_step_with_oom_after == 0 and big.debug.fail_step_with_oom_after is None
    assert big.scheduler.max_num_seqs == 256 and big.cache.block_size == 64 and big.lora.max_loras == 4
    assert tiny.model.dtype == "float32" and tiny.lora.allowed_roots == ("/tmp/models/adapters",)
    overrides = {d["name"]: d for d in app["deployments"]}
    gpus = 0.0
    for index, entry in enumerate(config.models):
        name = deployment_name(index, entry)
        options = llm_deployment_options(model_config(config, entry)) | overrides[name]
        gpus += options["ray_actor_options"]["num_gpus"]
    assert gpus == 1.0
