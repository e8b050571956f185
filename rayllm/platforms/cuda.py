"""CUDA: the worker's GPU is the current device, NCCL carries the collectives, cached blocks go back after an
out-of-memory step."""

from __future__ import annotations

import torch

from rayllm.platforms.interface import Platform


class CudaPlatform(Platform):
    dist_backend = "nccl"

    def setup_worker(self) -> None:
        torch.cuda.set_device(self.device)

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()
