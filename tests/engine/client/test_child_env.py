"""The engine child's GPU (engine_process.child_env): the child runs outside Ray, so it must be told which GPU
Ray assigned its replica. Ray normally narrows CUDA_VISIBLE_DEVICES to it, but not with
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, where the child's worker would take the first GPU of the node
(another replica's). Checked against our worker's device choice (worker.cuda_index), and on Ray with
declared GPUs (`ray.init(num_gpus=2)`: Ray assigns and sets the variables as on GPU nodes; no CUDA here).
"""

from __future__ import annotations

import os

import pytest
import ray

from rayllm.engine.client.engine_process import assigned_gpu_ids, child_env
from rayllm.executor.worker import cuda_index


def physical(visible: str | None, index: int) -> str:
    """The GPU that CUDA device `index` is under CUDA_VISIBLE_DEVICES `visible` (all when unset)."""
    return visible.split(",")[index] if visible else str(index)


@pytest.mark.parametrize("visible,assigned", [
    ("2", ["2"]),  # Ray narrowed the replica's variable
    (None, ["1"]),  # NOSET, every GPU visible
    ("0,1,2,3", ["3"]),  # NOSET, the node's own list
    ("GPU-aa,GPU-bb", ["GPU-bb"]),  # UUIDs
])
def test_the_child_uses_the_replicas_gpu(visible, assigned):
    replica = physical(visible, cuda_index(visible, assigned))  # what the replica's own worker would use
    environ = {"PATH": "/bin"} | ({"CUDA_VISIBLE_DEVICES": visible} if visible else {})
    child = child_env(environ, assigned).get("CUDA_VISIBLE_DEVICES")
    assert physical(child, cuda_index(child, [])) == replica  # the child: no Ray assignment, first visible
    assert child_env(environ, [])["PATH"] == "/bin" and child_env(environ, []).get("CUDA_VISIBLE_DEVICES") == visible


@ray.remote(num_gpus=1, runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}})
class Replica:
    def report(self) -> dict:
        return {"gpu_ids": assigned_gpu_ids(), "own": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "child": child_env(dict(os.environ), assigned_gpu_ids()).get("CUDA_VISIBLE_DEVICES")}


def test_replicas_with_noset_hand_their_own_gpu_to_the_child():
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        replicas = [Replica.remote() for _ in range(2)]
        reports = ray.get([r.report.remote() for r in replicas])
    finally:
        ray.shutdown()
    assert all(r["own"] is None for r in reports)  # NOSET: Ray left the variable alone
    assert sorted(r["child"] for r in reports) == ["0", "1"]  # each child its replica's GPU, not both GPU 0
    assert all([r["child"]] == r["gpu_ids"] for r in reports)
    assert assigned_gpu_ids() == []  # outside Ray
