"""The step's staged inputs (rayllm/runner/input_buffers.py) across a CUDA out-of-memory while they grow.

CUDA itself is mocked (no GPU here): its allocations are CPU tensors, the pinned flag is dropped, its events
are no-ops, and one device allocation fails as the CUDA caching allocator does when the card is full. The
engine survives an out-of-memory step (docs/gpu.md, GPU faults), so the buffers must still serve the next one.
"""

from __future__ import annotations

import pytest
import torch

from rayllm.runner.input_buffers import InputBuffers


class FakeCuda:
    def __init__(self, monkeypatch) -> None:
        self.fail_next = False
        real_empty = torch.empty

        def empty(*size, dtype=None, device=None, pin_memory=False):
            if device is not None and torch.device(device).type == "cuda" and self.fail_next:
                self.fail_next = False
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 KiB")
            return real_empty(*size, dtype=dtype)

        class Event:
            def record(self) -> None:
                pass

            def synchronize(self) -> None:
                pass

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.cuda, "Event", Event)


def test_an_out_of_memory_while_growing_leaves_the_buffers_usable(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    buffers = InputBuffers(torch.device("cuda", 0))
    small = [[1, 2, 3], [4, 5]]
    assert [t.tolist() for t in buffers.upload(small)] == small
    grown = [list(range(5000)), list(range(7, 3007))]
    cuda.fail_next = True  # the device buffer of the grown pair
    with pytest.raises(torch.OutOfMemoryError):
        buffers.upload(grown)
    assert buffers.host.numel() == buffers.dev.numel()
    # The next steps: one that fits the old buffers, then the grown one again once memory is back.
    assert [t.tolist() for t in buffers.upload([[9] * 100, [8]])] == [[9] * 100, [8]]
    assert [t.tolist() for t in buffers.upload(grown)] == grown
    assert buffers.host.numel() == buffers.dev.numel() >= 8000
