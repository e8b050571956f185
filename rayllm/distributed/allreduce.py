"""The tensor-parallel all-reduce, chosen once per process group: NCCL on CUDA; on CPU DeepSpeed's
shared-memory kernel or gloo (`parallel.cpu.allreduce`).

DeepSpeed's kernel (csrc/cpu/comm/shm.cpp, the op behind `deepspeed.comm.inference_all_reduce`) sums
through POSIX shared-memory segments that every rank maps, where gloo goes through TCP loopback. It
is used here directly, not through `deepspeed.init_distributed`: that would keep global state of its
own, and this module must decide, with every rank agreeing, whether the op is usable before any rank
calls its `initialize` (which waits forever for the segments of peers that never create theirs).
Only for ranks on one host: the executor places a group's ranks with STRICT_PACK.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from rayllm.common.errors import describe

log = logging.getLogger(__name__)

AllReduce = Callable[[torch.Tensor], torch.Tensor]

# DeepSpeed's shm kernels: fp32 needs avx2 (vector level 1), bf16/fp16 avx512bw (level 2); a missing ISA
# faults in the kernel and leaves the peers spinning on the shared flags.
_KERNEL_DTYPES = {0: frozenset(), 1: frozenset({torch.float32}),
                  2: frozenset({torch.float32, torch.bfloat16, torch.float16})}
_SHM_PREFIX = "deepspeed_allreduce_buffer"  # SHM_BUFFER_NAME in shm.cpp
# The kernel's `initialize` runs once per process (later calls are no-ops): the group it was set up for.
_shm_group: tuple[str, int, int] | None = None


def dist_all_reduce(group: dist.ProcessGroup | None) -> AllReduce:
    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return reduce


def shm_all_reduce(group: dist.ProcessGroup | None, dtypes: frozenset[torch.dtype]) -> AllReduce:
    """DeepSpeed's in-place shm sum. Other dtypes and non-contiguous tensors go through the process group:
    the kernel skips the former silently, and sums a contiguous copy of the latter, which it drops."""
    op = torch.ops.deepspeed.inference_all_reduce_

    def reduce(x: torch.Tensor) -> torch.Tensor:
        if x.dtype in dtypes and x.is_contiguous():
            return op(x)
        dist.all_reduce(x, group=group)
        return x

    return reduce


def _load_shm_op(dtype: torch.dtype):
    """(the compiled op module, the dtypes its kernels serve on this CPU). torch.utils.cpp_extension
    JIT-builds it into its extension cache the first time (~2 minutes); raises with the reason when it
    cannot serve `dtype` here."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    builder = ShareMemCommBuilder()
    if not builder.is_compatible():
        raise RuntimeError("DeepSpeed's shm comm op is not compatible with this platform")
    module = builder.load()
    level = module.vector_kernel_level()
    dtypes = _KERNEL_DTYPES[min(level, 2)]
    if dtype not in dtypes:
        raise RuntimeError(f"DeepSpeed's shm kernel has no {dtype} path on this CPU (vector level {level})")
    return module, dtypes


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _init_shm(module, rank: int, world: int, init_method: str, group: dist.ProcessGroup | None) -> None:
    """Create this rank's segment and map the peers'. The kernel names segments after MASTER_ADDR and
    MASTER_PORT, so the group's own TCP address keeps two groups on one host apart; it uses shm only when
    LOCAL_SIZE equals the world size. Once every rank has mapped every segment, each unlinks its own:
    the mappings stay, and no 66 MB segment per rank outlives the group (the kernel never unlinks)."""
    global _shm_group
    url = urlparse(init_method)
    addr, port = url.hostname or "", str(url.port or "")
    with _env({"LOCAL_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": addr, "MASTER_PORT": port}):
        module.initialize(world, rank)
    _shm_group = (init_method, rank, world)
    dist.barrier(group=group)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{_SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}")


def make_all_reduce(choice: str, device: torch.device, dtype: torch.dtype, rank: int, world: int,
                    init_method: str | None, group: dist.ProcessGroup | None) -> tuple[str, AllReduce]:
    """(backend name, the function every TP all-reduce goes through), for an initialised process group.
    Every rank of the group must call this at the same point: on CPU the ranks agree on the backend."""
    if device.type != "cpu":
        return dist.get_backend(group), dist_all_reduce(group)
    backend, reduce, reason = "gloo", dist_all_reduce(group), ""
    if choice != "gloo":
        module, dtypes = None, frozenset()
        cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
        if choice == "auto" and cores < world * threads + 1:
            # The kernel spins while it waits for a peer: with no core to spare, a descheduled rank
            # stalls its partners for a whole time slice, where gloo's waiting rank sleeps.
            reason = f"auto: {cores} cores leave none spare beside {world} ranks x {threads} threads"
        else:
            try:
                module, dtypes = _load_shm_op(dtype)
            except Exception as e:  # not installed, no compiler, no ISA: auto falls back, deepspeed fails below
                reason = describe(e)
        if module is not None and init_method is None:
            module, reason = None, "no TCP init address to name the shared-memory segments after"
        if module is not None and _shm_group not in (None, (init_method, rank, world)):
            module, reason = None, "this process already set DeepSpeed's shm all-reduce up for another group"
        # All ranks must have the op, on one host, or none uses it.
        views: list = [None] * world
        dist.all_gather_object(views, (module is not None, socket.gethostname(), reason), group=group)
        if not all(ok for ok, _, _ in views):
            reason = next(r for ok, _, r in views if not ok)
        elif len({host for _, host, _ in views}) > 1:
            reason = "the ranks are on more than one host"
        else:
            assert init_method is not None
            _init_shm(module, rank, world, init_method, group)
            backend, reduce = "deepspeed", shm_all_reduce(group, dtypes)
            _check(reduce, rank, world, dtype)
        if backend == "gloo" and choice == "deepspeed":
            raise RuntimeError(f"parallel.cpu.allreduce is deepspeed but its shm all-reduce is unusable: {reason}")
    if rank == 0:
        log.info("tp_allreduce backend=%s requested=%s world=%d dtype=%s reason=%r", backend, choice, world,
                 str(dtype).removeprefix("torch."), reason)
    return backend, reduce


def _check(reduce: AllReduce, rank: int, world: int, dtype: torch.dtype) -> None:
    """One sum through the kernel at start: a kernel that skipped the work would otherwise go unnoticed."""
    got = reduce(torch.full((64,), rank + 1.0, dtype=dtype))
    if not torch.all(got == world * (world + 1) / 2):
        raise RuntimeError(f"DeepSpeed's shm all-reduce gave {got[0].item()} on rank {rank}")
