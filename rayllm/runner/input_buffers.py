"""Step inputs staged on the host and copied to the device once per step.

On CUDA the host side is one pinned buffer reused across steps and the copy is `non_blocking`, so a
step costs one transfer and no host synchronisation (a `torch.tensor(list, device=cuda)` per field
copies from pageable memory, which waits for the stream). On CPU the host tensor is the input itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class InputBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.int64)
        self.dev = torch.empty(0, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None

    def upload(self, parts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One int64 tensor per part, on the device, all from one host buffer and one copy."""
        sizes = [len(p) for p in parts]
        src = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.int64)
        if not self.cuda:
            return list(src.split(sizes))
        n = src.numel()
        if self.host.numel() < n:
            capacity = max(n, 2 * self.host.numel(), 4096)
            # The old pinned buffer may still feed an in-flight copy; the caching host allocator keeps it
            # until that copy's stream has passed it. Both are replaced only once both exist: an
            # out-of-memory in either leaves the old pair, of one size, for the steps after it.
            host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
            self.host, self.dev = host, dev
        elif self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer (normally long ago)
        self.host[:n].copy_(src)
        dst = self.dev[:n]
        dst.copy_(self.host[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return list(dst.split(sizes))
