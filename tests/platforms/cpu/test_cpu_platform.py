"""The CPU platform hook (rayllm/platforms/cpu/platform.py): the worker's thread policy per step, when half
steps are on, and which weight forms it offers; platform_for picks it by device type. No model: steps are
SeqStep lists, and the thread count is torch's own."""

from __future__ import annotations

import pytest
import torch

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
