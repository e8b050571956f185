"""CPU: torch threads per rank and per step, half steps on two threads, oneDNN's prepacked weights and the
small-batch weight-only copies (`parallel.cpu`)."""

from __future__ import annotations

import torch

from rayllm.platforms.cpu import qgemm
from rayllm.platforms.cpu.cpus import usable_cpus
from rayllm.platforms.cpu.onednn import onednn_available
from rayllm.platforms.interface import Platform
from rayllm.schema.step import StepInput


class CpuPlatform(Platform):
    def setup_worker(self) -> None:
        self._refuse_batch_invariance_without_prepack()
        cpu, world = self.config.parallel.cpu, self.config.parallel.tensor_parallel_size
        threads = cpu.threads_per_rank or max(1, usable_cpus() // world)
        torch.set_num_threads(threads)
        self.step_threads = threads  # torch threads for a batch, and for one sequence alone:
        self.single_sequence_threads = cpu.threads_single_sequence
        # Batch-invariant mode keeps a step's thread count a function of the lone sequence only
        # (what its tests cover), so a prefill chunk's thread count never depends on its neighbours.
        self.wide_step_tokens = 0 if self.config.scheduler.batch_invariant else cpu.wide_step_tokens
        qgemm.POOL.threads = cpu.qgemm_threads if world == 1 else 0  # TP ranks already hold the cores

    def _refuse_batch_invariance_without_prepack(self) -> None:
        """Batch-invariant mode rests on oneDNN's prepacked GEMMs (plain F.linear's rows vary with the row
        count): refused before the weights load, rather than run without the invariance it promises."""
        dtype = getattr(torch, self.config.model.torch_dtype_name)
        if self.config.scheduler.batch_invariant and not onednn_available(self.device, dtype):
            fix = ("bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; set model.dtype: float32 or turn it off"
                   if dtype == torch.bfloat16 and onednn_available(self.device, torch.float32) else "turn it off")
            raise ValueError(f"scheduler.batch_invariant needs oneDNN's prepacked {dtype} GEMMs, which this "
                             f"device does not offer ({fix})")

    def before_step(self, step: StepInput) -> None:
        if self.single_sequence_threads:
            wide = len(step.seqs) == 1 or (
                self.wide_step_tokens > 0 and sum(len(s.token_ids) for s in step.seqs) >= self.wide_step_tokens)
            want = self.single_sequence_threads if wide else self.step_threads
            if torch.get_num_threads() != want:  # ~1 us; only when the batch crosses one sequence
                torch.set_num_threads(want)

    def half_step_tokens(self) -> int:
        """With one torch thread on a single rank (never in batch-invariant mode)."""
        par = self.config.parallel
        if self.step_threads == 1 and par.tensor_parallel_size == 1 and not self.config.scheduler.batch_invariant:
            return par.cpu.half_step_tokens
        return 0

    def small_batch_weights(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16

    def int8_activations(self) -> bool:
        return True

    def prepacked_gemms(self, dtype: torch.dtype) -> bool:
        return onednn_available(self.device, dtype)
