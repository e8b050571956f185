"""The CPU platform hook (rayllm/platforms/cpu/platform.py): the worker's thread policy per step, when half
steps are on, and which weight forms it offers; platform_for picks it by device type. No model: steps are
SeqStep lists, and the thread count is torch's own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rayllm.platforms.cpu.cpus import cgroup_cpu_quota, usable_cpus
from rayllm.platforms.cpu.platform import CpuPlatform
from rayllm.platforms.cuda import CudaPlatform
from rayllm.platforms.interface import Platform
from rayllm.platforms.select import platform_for
from rayllm.schema.config import CpuConfig, EngineConfig, ParallelConfig, SchedulerConfig
from rayllm.schema.step import SeqStep, StepInput


def config(batch_invariant: bool = False, tp: int = 1, **cpu) -> EngineConfig:
    return EngineConfig(parallel=ParallelConfig(device="cpu", tensor_parallel_size=tp, cpu=CpuConfig(**cpu)),
                        scheduler=SchedulerConfig(batch_invariant=batch_invariant))


def step(*tokens: int) -> StepInput:
    return StepInput([SeqStep(f"s{i}", [1] * n, 0, [0], sample=True) for i, n in enumerate(tokens)])


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_platform_for_picks_by_device_type():
    assert type(platform_for(config(), torch.device("cpu"))) is CpuPlatform
    assert type(platform_for(config(), torch.device("cuda", 0))) is CudaPlatform  # built only: set-up needs a GPU
    assert CudaPlatform.dist_backend == "nccl" and CpuPlatform.dist_backend == "gloo"
    assert type(platform_for(config(), torch.device("meta"))) is Platform  # no tuning


def test_threads_follow_the_step():
    """threads_single_sequence for a lone sequence or a step of wide_step_tokens+ tokens, else threads_per_rank."""
    cpu = CpuPlatform(config(threads_per_rank=1, threads_single_sequence=2, wide_step_tokens=10), torch.device("cpu"))
    cpu.setup_worker()
    assert torch.get_num_threads() == 1
    seen = []
    for s in (step(5), step(1, 1), step(6, 4), step(1, 1, 1)):
        cpu.before_step(s)
        seen.append(torch.get_num_threads())
    assert seen == [2, 1, 2, 1]


def test_batch_invariant_mode_ignores_wide_steps():
    cpu = CpuPlatform(config(True, threads_per_rank=1, threads_single_sequence=2, wide_step_tokens=10),
                      torch.device("cpu"))
    cpu.setup_worker()
    cpu.before_step(step(6, 4))
    assert torch.get_num_threads() == 1
    assert cpu.half_step_tokens() == 0  # nor half steps


def test_half_steps_need_one_thread_on_one_rank():
    def half(**kw) -> int:
        batch_invariant, tp = kw.pop("batch_invariant", False), kw.pop("tp", 1)
        p = CpuPlatform(config(batch_invariant, tp, half_step_tokens=48, **kw), torch.device("cpu"))
        p.setup_worker()
        return p.half_step_tokens()

    assert half(threads_per_rank=1) == 48
    assert half(threads_per_rank=2) == 0
    assert half(threads_per_rank=1, tp=2) == 0


def test_the_gemm_pool_is_for_a_single_rank():
    """qgemm_threads: the kernel pool's helper joins a single rank's GEMMs; tensor-parallel ranks already hold
    a core each, so theirs run on the rank's own thread."""
    from rayllm.platforms.cpu import qgemm

    before = qgemm.POOL.threads
    try:
        for tp, want in ((1, 2), (2, 0)):
            CpuPlatform(config(False, tp, threads_per_rank=1, qgemm_threads=2), torch.device("cpu")).setup_worker()
            assert qgemm.POOL.threads == want, tp
    finally:
        qgemm.POOL.threads = before


def test_weight_forms_follow_the_dtype():
    cpu = CpuPlatform(config(), torch.device("cpu"))
    assert cpu.small_batch_weights(torch.bfloat16) and not cpu.small_batch_weights(torch.float32)
    assert cpu.int8_activations()
    base = Platform(config(), torch.device("cpu"))
    assert not base.small_batch_weights(torch.bfloat16) and not base.prepacked_gemms(torch.bfloat16)


CHILD_THREADS = """
import torch
from rayllm.platforms.cpu.platform import CpuPlatform
from rayllm.schema.config import CpuConfig, EngineConfig, ParallelConfig
CpuPlatform(EngineConfig(parallel=ParallelConfig(device="cpu", cpu=CpuConfig())), torch.device("cpu")).setup_worker()
print(torch.get_num_threads())
"""


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs util-linux's taskset")
def test_threads_per_rank_zero_follows_the_affinity_mask():
    """A process pinned to one CPU (taskset, as a pod's cpuset pins it) runs one torch thread, whatever the
    node's core count; torch's own default would have counted every core."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("OMP_NUM_THREADS", None)
    pinned = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", CHILD_THREADS], capture_output=True,
                            text=True, cwd=root, env=env, timeout=120, check=True, stdin=subprocess.DEVNULL)
    assert pinned.stdout.split()[-1] == "1"
    assert usable_cpus(membership=Path("/nonexistent")) == len(os.sched_getaffinity(0))


def cgroups(tmp_path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup mount (files relative to it) and a fake /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self_cgroup").write_text(membership)
    return root, tmp_path / "self_cgroup"


def test_threads_per_rank_zero_is_capped_by_the_cgroup_quota(tmp_path):
    """cgroup v2 cpu.max of this cgroup or an ancestor (a pod's limits.cpu), v1 cpu.cfs_quota_us; rounded down,
    at least one; no quota leaves the affinity mask's count."""
    cpus = len(os.sched_getaffinity(0))
    v2 = "0::/kubepods/pod1/ctr\n"
    root, member = cgroups(tmp_path / "a", v2, {"kubepods/pod1/ctr/cpu.max": "150000 100000\n"})
    assert cgroup_cpu_quota(root, member) == 1.5 and usable_cpus(root, member) == 1
    root, member = cgroups(tmp_path / "b", v2, {"kubepods/pod1/cpu.max": "50000 100000\n",
                                                "kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, member) == 0.5 and usable_cpus(root, member) == 1
    root, member = cgroups(tmp_path / "c", v2, {"kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, member) is None and usable_cpus(root, member) == cpus
    root, member = cgroups(tmp_path / "d", v2, {"kubepods/pod1/ctr/cpu.max": f"{64 * 100000} 100000\n"})
    assert usable_cpus(root, member) == cpus  # a quota above the mask: the mask
    # v1 inside a container without a cgroup namespace: the host's path, the container's cgroup at the root.
    v1 = "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n"
    root, member = cgroups(tmp_path / "e", v1, {"cpu,cpuacct/cpu.cfs_quota_us": "100000\n",
                                                "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root, member) == 1.0 and usable_cpus(root, member) == 1
    root, member = cgroups(tmp_path / "f", v1, {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                                "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(root, member) is None
