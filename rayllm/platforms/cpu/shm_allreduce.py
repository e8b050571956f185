"""The shared-memory all-reduce of CPU ranks on one host (csrc/shm_allreduce.c), bound with ctypes.

One segment in /dev/shm per group: the group's first rank creates it, every rank maps it, and the first rank
unlinks it once all have mapped it, so nothing is left behind whatever way the ranks end. The segment's
pages are allocated when it is created (a full /dev/shm is an error here, not a SIGBUS in the middle of a
step). The kernel is built with the other CPU kernels (rayllm.platforms.cpu.kernels: plain C, cached).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

from rayllm.platforms.cpu import kernels

# Per rank and per round: messages larger than this go through in chunks. Two rounds of world + 1 slots:
# 12 MiB of /dev/shm for two ranks (Docker's default /dev/shm is 64 MiB).
SLOT_BYTES = 2 << 20
TIMEOUT_S = 120.0  # a live peer that has not arrived by then is stuck: the call raises
DTYPES = frozenset({torch.float32, torch.bfloat16})


def segment_path(name: str) -> Path:
    return Path("/dev/shm") / name


class ShmAllReduce:
    """This rank's view of a group's segment; call it with a contiguous CPU tensor of a DTYPES dtype, which is
    summed across the group in place. Every rank of the group must make the same calls in the same order."""

    def __init__(self, name: str, rank: int, world: int, *, create: bool, slot_bytes: int = SLOT_BYTES,
                 timeout_s: float = TIMEOUT_S):
        lib = ctypes.CDLL(str(kernels.build()))
        seg_bytes = lib.shm_allreduce_segment_bytes
        seg_bytes.argtypes, seg_bytes.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_int64
        self._fn = lib.shm_allreduce
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                             ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                             ctypes.c_double]
        self._fn.restype = ctypes.c_int
        if not 1 <= world <= lib.shm_allreduce_max_world():
            raise ValueError(f"the shared-memory all-reduce serves 1 to {lib.shm_allreduce_max_world()} ranks, not {world}")
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self.nbytes = seg_bytes(world, slot_bytes)
        path = segment_path(name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, self.nbytes)  # zeroed pages, all allocated now
                except OSError:
                    os.unlink(path)
                    raise
            elif os.fstat(fd).st_size != self.nbytes:
                raise RuntimeError(f"shared-memory segment {path} has {os.fstat(fd).st_size} bytes, not {self.nbytes}")
            self._map = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self._base = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(self._map)))
        lib.shm_allreduce_attach.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.shm_allreduce_attach(self._base, rank)  # its pid: the peers' waits notice if this process exits
        self._round = ctypes.c_uint64(0)
        self.broken = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.broken:
            raise RuntimeError("the shared-memory all-reduce timed out earlier; its group is out of step")
        code = self._fn(self._base, self.world, self.rank, self.slot_bytes, ctypes.byref(self._round),
                        x.data_ptr(), x.numel(), int(x.dtype == torch.bfloat16), self.timeout_s)
        if code != 0:
            self.broken = True
            why = "exited" if code == -2 else f"did not arrive within {self.timeout_s:g} s"
            raise RuntimeError(f"shared-memory all-reduce: a peer of rank {self.rank} {why}")
        return x
