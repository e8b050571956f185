"""The platform of a worker's device."""

from __future__ import annotations

import torch

from rayllm.platforms.cpu.platform import CpuPlatform
from rayllm.platforms.cuda import CudaPlatform
from rayllm.platforms.interface import Platform
from rayllm.schema.config import EngineConfig

PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def platform_for(config: EngineConfig, device: torch.device) -> Platform:
    """A device type without an entry gets the base class: no tuning."""
    return PLATFORMS.get(device.type, Platform)(config, device)
