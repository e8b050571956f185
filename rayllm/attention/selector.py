"""Which attention backend a worker runs, from the table in registry.py."""

from __future__ import annotations

import importlib
import logging

import torch

from rayllm.attention.base import AttentionBackend
from rayllm.attention.registry import BACKENDS, CUDA_AUTO
from rayllm.common.errors import first_line
from rayllm.platforms.cpu import kernels as cpu_kernels

log = logging.getLogger(__name__)

def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose auto or one of {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_attention_backend(choice: str, device: torch.device, head_dim: int = 64,
                           dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """auto: on CUDA, the first of CUDA_AUTO that imports, compiles and agrees with torch on this device at
    the model's head dim and dtype, else torch SDPA; on CPU, SDPA with the C kernels when they build. sdpa:
    torch only (the reference path). An explicit choice is honoured or fails."""
    if choice == "sdpa":
        return backend_class("sdpa")()
    if choice == "auto" and device.type != "cuda":
        return backend_class("sdpa")(cpu_kernels.load())
    if choice != "auto" and device.type != "cuda" and choice in CUDA_AUTO:
        raise ValueError(f"attention_backend {choice} needs CUDA")
    for name in (CUDA_AUTO if choice == "auto" else (choice,)):
        try:
            backend = backend_class(name)()
            backend.probe(device, head_dim, dtype)
            return backend
        except Exception as exc:  # missing extra, built for another torch/CUDA, or no compiler for this GPU
            if choice == name:
                raise
            log.warning("%s attention unavailable (%s)", name, first_line(exc))
    log.warning("using torch SDPA attention")
    return backend_class("sdpa")()
