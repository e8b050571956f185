"""The one hook between generic code and its device: a worker holds a `Platform` (select.py picks it) and asks
it instead of testing the device type. cpu/platform.py and cuda.py implement it; this base class is what a
device without special tuning does."""

from __future__ import annotations

import torch

from rayllm.schema.config import EngineConfig
from rayllm.schema.step import StepInput


class Platform:
    """What a worker asks of its device: process set-up, tuning per step, the collectives' backend, which
    weight forms its GEMMs offer, and giving cached memory back."""

    dist_backend = "gloo"  # torch.distributed backend of the tensor-parallel group

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def setup_worker(self) -> None:
        """Once, before the model is built (the current device, thread counts)."""

    def before_step(self, step: StepInput) -> None:
        """Before each step the worker runs."""

    def half_step_tokens(self) -> int:
        """Steps of at least this many tokens run in two halves on two threads (runner.enable_halves); 0: never."""
        return 0

    def small_batch_weights(self, dtype: torch.dtype) -> bool:
        """Whether quantized checkpoints' layers get weight-only int4/int8 copies for small steps."""
        return False

    def int8_activations(self) -> bool:
        """Whether 4-bit layers may quantize their activations to int8 (cpu_qgemm's kernel, where the CPU has it)."""
        return False

    def prepacked_gemms(self, dtype: torch.dtype) -> bool:
        """Whether dense weights can be laid out once for the GEMMs (oneDNN), which batch-invariant mode needs."""
        return False

    def release_cached_memory(self) -> None:
        """Give the allocator's cached blocks back (after an out-of-memory step, at shutdown)."""
