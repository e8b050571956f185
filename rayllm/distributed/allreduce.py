"""The tensor-parallel all-reduce, chosen once per process group: NCCL on CUDA; on CPU the shared-memory kernel
of rayllm.platforms.cpu.shm_allreduce or gloo (`parallel.cpu.allreduce`).

The shared-memory kernel sums through one segment that every rank maps, where gloo goes through TCP
loopback. Only for ranks on one host: the executor places a group's ranks with STRICT_PACK.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from rayllm.common.errors import describe
from rayllm.platforms.cpu.shm_allreduce import DTYPES, ShmAllReduce, segment_path

log = logging.getLogger(__name__)

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def dist_all_reduce(group: dist.ProcessGroup | None) -> AllReduce:
    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return reduce


def shm_all_reduce(group: dist.ProcessGroup | None, kernel: ShmAllReduce) -> AllReduce:
    """The kernel's in-place sum; other dtypes and non-contiguous tensors go through the process group."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if x.dtype in DTYPES and x.is_contiguous():
            return kernel(x)
        dist.all_reduce(x, group=group)
        return x

    return reduce


def _open_shm(rank: int, world: int, group: dist.ProcessGroup | None) -> tuple[ShmAllReduce | None, str]:
    """(this rank's kernel, "") when every rank mapped the group's segment, else (None, the first reason).
    The first rank names and creates the segment, the others map it, then the first unlinks it."""
    names = [f"rayllm-allreduce-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"]
    dist.broadcast_object_list(names, group_src=0, group=group)
    kernel, reason = None, ""
    if rank == 0:
        try:
            kernel = ShmAllReduce(names[0], rank, world, create=True)
        except Exception as e:  # no compiler, /dev/shm missing or full
            reason = describe(e)
    created: list = [None] * world
    dist.all_gather_object(created, reason, group=group)
    if created[0]:
        return None, created[0]
    if rank != 0:
        try:
            kernel = ShmAllReduce(names[0], rank, world, create=False)
        except Exception as e:
            reason = describe(e)
    views: list = [None] * world
    dist.all_gather_object(views, reason, group=group)
    if rank == 0:
        segment_path(names[0]).unlink(missing_ok=True)  # every rank has it mapped (or gave up)
    failed = next((r for r in views if r), "")
    return (None, failed) if failed else (kernel, "")


def make_all_reduce(choice: str, device: torch.device, dtype: torch.dtype, rank: int, world: int,
                    group: dist.ProcessGroup | None) -> tuple[str, AllReduce]:
    """(backend name, the function every TP all-reduce goes through), for an initialised process group.
    Every rank of the group must call this at the same point: on CPU the ranks agree on the backend."""
    if device.type != "cpu":
        return dist.get_backend(group), dist_all_reduce(group)
    backend, reduce, reason = "gloo", dist_all_reduce(group), ""
    if choice != "gloo":
        # All ranks on one host (the segment is local), or none uses it. No spare core is needed: the kernel
        # yields the core while it waits, so a descheduled peer gets it (docs/benchmarks.md, CPU tensor parallel).
        hosts: list = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if dtype not in DTYPES:
            reason = f"the kernel has no {str(dtype).removeprefix('torch.')} path"
        elif len(set(hosts)) > 1:
            reason = "the ranks are on more than one host"
        else:
            kernel, reason = _open_shm(rank, world, group)
            if kernel is not None:
                backend, reduce = "shm", shm_all_reduce(group, kernel)
                _check(reduce, rank, world, dtype)
        if backend == "gloo" and choice == "shm":
            raise RuntimeError(f"parallel.cpu.allreduce is shm but the shared-memory all-reduce is unusable: {reason}")
    if rank == 0:
        log.info("tp_allreduce backend=%s requested=%s world=%d dtype=%s reason=%r", backend, choice, world,
                 str(dtype).removeprefix("torch."), reason)
    return backend, reduce


def _check(reduce: AllReduce, rank: int, world: int, dtype: torch.dtype) -> None:
    """One sum through the kernel at start: a kernel that skipped the work would otherwise go unnoticed."""
    got = reduce(torch.full((64,), rank + 1.0, dtype=dtype))
    if not torch.all(got == world * (world + 1) / 2):
        raise RuntimeError(f"the shared-memory all-reduce gave {got[0].item()} on rank {rank}")
