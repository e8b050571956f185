"""GPU placement, tested on a CPU machine: Ray schedules *declared* GPUs (`ray.init(num_gpus=2)`) and
sets CUDA_VISIBLE_DEVICES per actor exactly as on GPU nodes, so the reservations the builder and the
executor make are checked for real. No CUDA is touched: the actors report what Ray assigned them and
the device our worker would pick from it (worker.select_device's index arithmetic), not a tensor.
"""

from __future__ import annotations

import os

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayllm.executor.executor import rank_actor_resources, resolve_local_device
from rayllm.executor.worker import cuda_index
from rayllm.serve.builder import (
    build_app_with,
    check_fits_one_node,
    llm_deployment_options,
    placement_bundles,
    replica_actor_options,
    resolve_device,
    with_resolved_device,
)
from rayllm.serve.config import ServerConfig


def _config(device: str = "cuda", tp: int = 1, executor: str = "auto") -> ServerConfig:
    return ServerConfig.from_args({"engine": {"parallel": {"device": device, "tensor_parallel_size": tp,
                                                           "executor": executor}}})


@ray.remote
class Probe:
    """Reports what Ray gave this actor and the CUDA index our worker derives from it."""

    def report(self) -> dict:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [str(g) for g in ray.get_gpu_ids()]
        return {"gpu_ids": ids, "visible": visible, "cuda_index": cuda_index(visible, ids)}


@pytest.fixture(scope="module")
def gpu_cluster():
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_cuda_index_follows_ray_assignment():
    assert cuda_index("3", ["3"]) == 0  # Ray narrowed the visible set to the assigned GPU
    assert cuda_index("0,1,2,3", ["2"]) == 2  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    assert cuda_index(None, ["5"]) == 5  # everything visible: the physical id
    assert cuda_index("1", []) == 0  # the engine's child process: inherits its replica's single GPU
    with pytest.raises(RuntimeError, match="assigned GPU 4"):
        cuda_index("0,1", ["4"])


def test_auto_device_is_decided_once_from_cluster_resources():
    assert resolve_device("auto", {"CPU": 8.0, "GPU": 2.0}) == "cuda"
    assert resolve_device("auto", {"CPU": 8.0}) == "cpu"  # e.g. a head without GPUs and no GPU workers
    assert resolve_device("cpu", {"GPU": 8.0}) == "cpu"  # an explicit choice stands
    resolved = with_resolved_device(_config("auto"), {"CPU": 4.0, "GPU": 1.0})
    assert resolved.engine.parallel.device == "cuda"
    # The engine's own fallback (no builder): resolved from this machine, which has no CUDA.
    assert resolve_local_device(_config("auto").engine).parallel.device == "cpu"


def test_replica_options_reserve_a_gpu_for_every_rank():
    # TP=1 in the replica: the replica itself holds the GPU.
    assert replica_actor_options(_config()) == {"num_cpus": 1.0, "num_gpus": 1}
    assert placement_bundles(_config()) is None
    # TP=1 on a Ray actor, and TP=2: the replica's bundle has no GPU, each rank's bundle one.
    assert placement_bundles(_config(executor="ray")) == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert placement_bundles(_config(tp=2)) == [{"CPU": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert "num_gpus" not in replica_actor_options(_config(tp=2))
    # CPU engines ask for no GPU anywhere.
    assert replica_actor_options(_config("cpu")) == {"num_cpus": 1.0}
    assert placement_bundles(_config("cpu", tp=2)) == [{"CPU": 1.0}] * 3


def test_two_tp1_replicas_get_different_gpus(gpu_cluster):
    options = llm_deployment_options(_config())["ray_actor_options"]
    replicas = [Probe.options(**options).remote() for _ in range(2)]
    reports = ray.get([r.report.remote() for r in replicas])
    assert sorted(r["gpu_ids"][0] for r in reports) == ["0", "1"]
    for r in reports:
        assert r["visible"] == r["gpu_ids"][0] and r["cuda_index"] == 0
    # A third replica cannot get a GPU: it waits for one (or for the autoscaler) rather than share.
    third = Probe.options(**options).remote()
    ready, _ = ray.wait([third.report.remote()], timeout=2)
    assert not ready
    for actor in replicas + [third]:
        ray.kill(actor)


def test_tp2_ranks_get_one_gpu_each_from_the_replica_bundles(gpu_cluster):
    config = _config(tp=2)
    pg = placement_group(placement_bundles(config), strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    ranks = [Probe.options(**rank_actor_resources(True), scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=1 + rank)).remote() for rank in range(2)]
    reports = ray.get([r.report.remote() for r in ranks])
    assert sorted(r["gpu_ids"][0] for r in reports) == ["0", "1"]
    assert all(r["visible"] == r["gpu_ids"][0] and r["cuda_index"] == 0 for r in reports)
    for actor in ranks:
        ray.kill(actor)
    remove_placement_group(pg)


def test_unmet_demand_names_gpus(gpu_cluster):
    """What the autoscaler sees when a replica's bundles do not fit: a demand for GPU bundles."""
    from ray.autoscaler.v2.sdk import get_cluster_status

    pg = placement_group(placement_bundles(_config(tp=3)), strategy="STRICT_PACK")  # 3 GPUs > 2 declared
    gcs = ray.get_runtime_context().gcs_address
    try:
        for _ in range(50):
            demands = get_cluster_status(gcs).resource_demands.placement_group_demand
            shapes = [b.bundle for d in demands for b in d.bundles_by_count]
            if shapes:
                break
            ray.get(ray.remote(lambda: None).remote())  # give the GCS a moment without sleeping blindly
        assert {"CPU": 1.0, "GPU": 1.0} in shapes
    finally:
        remove_placement_group(pg)


def test_build_app_binds_the_resolved_device(gpu_cluster):
    """build_app resolves `auto` from this (declared-GPU) cluster and binds that into the engine config,
    and the model deployment asks Serve for a GPU per replica."""
    app = build_app_with(with_resolved_device(_config("auto"), {}))  # already resolved: cpu stays cpu
    llm = _llm_deployment(app)
    assert llm.init_args[0].parallel.device == "cpu"
    app = build_app_with(_config("auto"))
    llm = _llm_deployment(app)
    assert llm.init_args[0].parallel.device == "cuda"
    assert llm.ray_actor_options["num_gpus"] == 1


def _llm_deployment(app):
    ingress = app._bound_deployment
    bound = [*ingress.init_args, *ingress.init_kwargs.values()]
    args = [v for a in bound for v in (a.values() if isinstance(a, dict) else [a])]  # llms: a dict
    return next(a for a in args if getattr(a, "_bound_deployment", None) is not None
                and a._bound_deployment.name == "llm")._bound_deployment


# ---- several models, several nodes (issue 20) ----------------------------------------------------------

def _node(cpus: float, gpus: float = 0.0, alive: bool = True) -> dict:
    """One entry of `ray.nodes()` (the fields the check reads)."""
    return {"Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus, "memory": 1e9} if gpus else {"CPU": cpus}}


def test_tensor_parallel_wider_than_any_node_is_refused():
    """TP ranks of one replica are packed on one node: TP=4 on CPU needs 1 + 4 CPUs on a single node."""
    config = _config("cpu", tp=4)
    check_fits_one_node(config, [_node(2), _node(5)])  # the second node holds the replica
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 needs 5 CPU on one node .* largest node has 4 CPU"):
        check_fits_one_node(config, [_node(4), _node(4), _node(8, alive=False)])
    gpu = _config("cuda", tp=2)
    check_fits_one_node(gpu, [_node(4, gpus=2)])
    with pytest.raises(ValueError, match=r"needs 3 CPU, 2 GPU on one node .* largest node has 16 CPU, 1 GPU"):
        check_fits_one_node(gpu, [_node(16, gpus=1), _node(16, gpus=1)])
    check_fits_one_node(_config("cpu", tp=1), [_node(0.5)])  # the engine runs in the replica: no bundles


def test_one_deployment_per_model(tmp_path):
    """The first model's deployment keeps the name `llm`; each other model gets its own, with its own
    Serve options; one tokenizer deployment knows every model's files."""
    (tmp_path / "config.json").write_text("{}")  # a model directory (only its path is bound here)
    config = ServerConfig.from_args({"models": [
        {"engine": {"parallel": {"device": "cpu"}}, "aliases": ["smol"]},
        {"served_model_name": "tiny/v1", "engine": {"model": {"model": str(tmp_path)}, "parallel": {"device": "cpu"}},
         "deployment": {"num_replicas": 2}},
    ]})
    ingress = build_app_with(config)._bound_deployment
    tokenizer, llms = ingress.init_kwargs["tokenizer"]._bound_deployment, ingress.init_kwargs["llms"]
    deployments = {name: h._bound_deployment for name, h in llms.items()}
    assert {n: d.name for n, d in deployments.items()} == {"SmolLM2-135M-Instruct": "llm", "tiny/v1": "llm-tiny-v1"}
    assert deployments["tiny/v1"].num_replicas == 2 and deployments["SmolLM2-135M-Instruct"].num_replicas == 1
    assert deployments["tiny/v1"].init_args[1] == str(tmp_path)
    assert tokenizer.init_args[0] == {"SmolLM2-135M-Instruct": deployments["SmolLM2-135M-Instruct"].init_args[1],
                                      "tiny/v1": str(tmp_path)}
