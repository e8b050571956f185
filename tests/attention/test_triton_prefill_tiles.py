"""The prefill kernel's tiles fit each GPU's shared memory (rayllm/attention/triton_prefill.py, TILES).

A launch whose kernel needs more shared memory per block than the device allows fails with Triton's
OutOfResources: at head dim 256 the two-stage 64 x 64 tiles take 106,496 B, over the 101,376 B of sm_86 /
sm_89 (A10, L4, L40S, RTX 4090), and every Gemma 2/3 prefill failed there. No GPU is here: MEASURED is what
Triton's real NVIDIA compiler reported for each target, compiled without a GPU by
`python tests/attention/prefill_smem.py <cap> <jobs>` (only CUDA mocked: a fake active driver; Triton 3.9),
and one case is compiled again below when the compiler can run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # the kernels of this process run in the interpreter (test_triton_prefill.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from rayllm.attention.triton_prefill import TILES, PrefillConfig, default_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Shared memory per block each GPU generation allows (cudaDevAttrMaxSharedMemoryPerBlockOptin, torch's
# shared_memory_per_block_optin): the CUDA C Programming Guide's table of compute capabilities.
LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}

_HALF = {(256, (64, 64, 8, 2)): 106_496, (256, (64, 64, 8, 1)): 98_304, (256, (64, 32, 4, 2)): 69_632,
         (128, (128, 64, 8, 3)): 65_544, (128, (64, 64, 4, 2)): 57_344, (256, (16, 32, 4, 2)): 41_984,
         (128, (16, 64, 4, 2)): 38_912}
_FP32 = {(256, (32, 16, 4, 2)): 67_712, (128, (64, 32, 4, 2)): 73_984, (256, (16, 16, 4, 2)): 50_240,
         (128, (16, 32, 4, 2)): 43_008}
# (cap, element bytes, padded head dim, (block_m, block_n, warps, stages)) -> bytes, from prefill_smem.py's
# output: sm_80, sm_86 and sm_89 compile alike; sm_90 pipelines more.
MEASURED = {(cap, 2, d, t): b for cap in (80, 86, 89) for (d, t), b in _HALF.items()}
MEASURED |= {(cap, 4, d, t): b for cap in (80, 86, 89, 90) for (d, t), b in _FP32.items()}
MEASURED |= {(90, 2, d, t): b for (d, t), b in {
    (256, (64, 64, 8, 2)): 163_840, (256, (64, 64, 8, 1)): 98_304, (256, (64, 32, 4, 2)): 98_304,
    (128, (128, 64, 8, 3)): 98_308, (128, (64, 64, 4, 2)): 81_920, (256, (16, 32, 4, 2)): 41_984,
    (128, (16, 64, 4, 2)): 38_912}.items()}


def _key(cap: int, dtype: torch.dtype, head_dim: int, cfg: PrefillConfig) -> tuple:
    block_d = 128 if head_dim <= 128 else 256  # the padded head dim; 64 and 80 take less than 128
    return cap, torch.empty((), dtype=dtype).element_size(), block_d, (cfg.block_m, cfg.block_n, cfg.num_warps,
                                                                      cfg.num_stages)


@pytest.mark.parametrize("cap", sorted(LIMITS))
def test_the_tiles_chosen_for_each_gpu_fit_its_shared_memory(cap):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (64, 80, 128, 256):
            for q_rows in (1, 150):
                cfg = default_config(head_dim, dtype, q_rows, LIMITS[cap])
                assert MEASURED[_key(cap, dtype, head_dim, cfg)] <= LIMITS[cap], (dtype, head_dim, q_rows, cfg)


def test_the_table_bounds_every_measurement_and_keeps_the_fast_tiles_where_they_fit():
    for (fp32, wide, _), choices in TILES.items():
        for cfg, shared in choices:
            for cap in LIMITS:
                assert MEASURED[_key(cap, torch.float32 if fp32 else torch.half, 256 if wide else 128, cfg)] <= shared
    gemma = {cap: default_config(256, torch.bfloat16, 150, limit) for cap, limit in LIMITS.items()}
    assert gemma == {80: PrefillConfig(64, 64, 8, 2), 86: PrefillConfig(64, 64, 8, 1),
                     89: PrefillConfig(64, 64, 8, 1), 90: PrefillConfig(64, 64, 8, 2)}
    assert default_config(128, torch.bfloat16, 150, LIMITS[86]) == PrefillConfig(128, 64, 8, 3)
    assert default_config(256, torch.bfloat16, 150) == PrefillConfig(64, 64, 8, 2)  # no limit: the interpreter
    assert default_config(512, torch.bfloat16, 150, LIMITS[86]) == PrefillConfig(64, 64, 8, 1)  # smallest; probed


def test_the_compiler_agrees_on_sm86_at_head_dim_256():
    """The reviewed failure, compiled again: bf16 Gemma prefill tiles for sm_86 (in a process of its own:
    the fake driver replaces Triton's for the whole process)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    cfg = default_config(256, torch.bfloat16, 150, LIMITS[86])
    job = f"bf16:256:{cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests/attention/prefill_smem.py"), "86", job],
                         capture_output=True, text=True, env=env, timeout=500)
    if run.returncode and "ptxas" in run.stderr:
        pytest.skip(f"Triton's NVIDIA compiler cannot run here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    shared = int(run.stdout.split()[-1])
    assert shared == MEASURED[_key(86, torch.bfloat16, 256, cfg)] <= LIMITS[86]
