"""Runs the ranks: in-process for tensor_parallel_size 1, one Ray actor per rank otherwise.

Each engine step is one `execute` per rank; rank 0's result carries the sampled tokens.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import torch

from rayllm.common import startup_phases
from rayllm.executor.worker import Worker
from rayllm.platforms.cpu.kernels import onednn_cache_env
from rayllm.runner import kv_cache
from rayllm.schema.config import EngineConfig, LlamaArch, for_device
from rayllm.schema.step import StepInput, StepOutput

log = logging.getLogger(__name__)


class LocalExecutor:
    def __init__(self, config: EngineConfig, model_path: str, arch: LlamaArch):
        with startup_phases.phase("load"):
            self.worker = Worker(config, model_path, arch, rank=0, dist_init=None)
        with startup_phases.phase("kv_cache"):  # profiling the free memory, then allocating the blocks
            self.num_blocks = kv_cache.require_blocks(self.worker.available_kv_blocks(), config)
            self.worker.init_cache(self.num_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        out = self.worker.execute(step)
        assert out is not None
        return out

    def score(self, token_ids: list[int], lora_id: int = 0):
        return self.worker.score(token_ids, lora_id)

    def load_lora(self, slot: int, lora_id: int, path: str) -> int:
        return self.worker.load_lora(slot, lora_id, path)

    def unload_lora(self, slot: int) -> None:
        self.worker.unload_lora(slot)

    def check_health(self) -> None:
        return None

    def device_memory(self) -> tuple[str, int]:
        return self.worker.device_memory()

    def shutdown(self) -> None:
        self.worker.shutdown()


def actor_name_prefix() -> str:
    """`rayllm-tp:<app>:<deployment>:<replica>:` inside a Serve replica, so operators (and tests) can find
    a replica's rank actors with `ray list actors` / `ray.get_actor`; a unique id elsewhere."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return f"rayllm-tp:{ctx.app_name}:{ctx.deployment}:{ctx.replica_id.unique_id}:"
    except Exception:  # not in a Serve replica
        return f"rayllm-tp:{uuid.uuid4().hex[:12]}:"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_actor_resources(on_gpu: bool) -> dict[str, float]:
    """What each rank actor reserves inside its bundle: one GPU each on CUDA (Ray then sets the actor's
    CUDA_VISIBLE_DEVICES to that GPU, which Worker picks up through worker.select_device)."""
    return {"num_gpus": 1, "num_cpus": 1} if on_gpu else {"num_cpus": 1}


class RayExecutor:
    """One actor per rank, placed in the caller's placement group (a Serve replica's bundles) or a new one."""

    def __init__(self, config: EngineConfig, model_path: str, arch: LlamaArch):
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        tp = config.parallel.tensor_parallel_size
        on_gpu = config.parallel.device == "cuda"
        resources = rank_actor_resources(on_gpu)
        pg = get_current_placement_group()
        first_bundle = 1  # inside a Serve replica, bundle 0 is the replica itself
        if pg is None:
            bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
            pg = placement_group([bundle] * tp, strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=300)
            self._own_pg = pg
            first_bundle = 0
        else:
            self._own_pg = None
        ip = ray.util.get_node_ip_address()
        init = f"tcp://{ip}:{_free_port()}"
        actor_cls = ray.remote(Worker)
        prefix = actor_name_prefix()
        self.actor_names = [f"{prefix}rank{rank}" for rank in range(tp)]
        self.workers = [
            actor_cls.options(
                **resources,
                name=self.actor_names[rank],
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=first_bundle + rank
                ),
                max_concurrency=1,
                runtime_env={"env_vars": onednn_cache_env(os.environ)},  # set before the rank's torch starts
            ).remote(config, model_path, arch, rank, init)
            for rank in range(tp)
        ]
        ray.get([w.ping.remote() for w in self.workers])
        blocks = min(ray.get([w.available_kv_blocks.remote() for w in self.workers]))
        self.num_blocks = kv_cache.require_blocks(blocks, config)
        ray.get([w.init_cache.remote(self.num_blocks) for w in self.workers])
        log.info("tensor-parallel workers ready: %d ranks, %d KV blocks", tp, self.num_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        ref = self.ray.put(step)  # serialised once, shared by every rank
        results = self.ray.get([w.execute.remote(ref) for w in self.workers])
        assert results[0] is not None
        return results[0]

    def score(self, token_ids: list[int], lora_id: int = 0):
        return self.ray.get([w.score.remote(token_ids, lora_id) for w in self.workers])[0]

    def load_lora(self, slot: int, lora_id: int, path: str) -> int:
        """Every rank loads its own shard. The slot is unused by running sequences, so ranks may load it
        between different steps without disagreeing on any step's result."""
        return self.ray.get([w.load_lora.remote(slot, lora_id, path) for w in self.workers])[0]

    def unload_lora(self, slot: int) -> None:
        self.ray.get([w.unload_lora.remote(slot) for w in self.workers])

    def check_health(self) -> None:
        self.ray.get([w.ping.remote() for w in self.workers], timeout=30)

    def device_memory(self) -> tuple[str, int]:
        return "", 0  # each rank holds its GPU in its own actor; a stats poll should not wait on one

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                self.ray.kill(w)
            except Exception:  # already gone
                pass
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._own_pg)


def resolve_local_device(config: EngineConfig) -> EngineConfig:
    """An engine started outside build_app (tests, benchmarks) decides `device: auto` here, once, from
    this machine, and the settings whose `auto` depends on it; under Serve the builder has already done so
    from the cluster's resources."""
    device = config.parallel.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return for_device(config, device)


def make_executor(config: EngineConfig, model_path: str, arch: LlamaArch) -> LocalExecutor | RayExecutor:
    config = resolve_local_device(config)
    if config.parallel.tensor_parallel_size == 1 and config.parallel.executor == "auto":
        return LocalExecutor(config, model_path, arch)
    return RayExecutor(config, model_path, arch)
