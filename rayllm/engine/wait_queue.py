"""The scheduler's queue of waiting sequences: first come first served, or by priority with aging. No torch.

Priority (vLLM's convention: lower is served first) ages linearly: a request of priority p that arrived
at scheduler step t ranks as if it had priority p - (now - t) / aging_steps. Since every waiting request
ages at the same rate, that order is the static key p * aging_steps + t, so a heap keeps it and no key
is ever recomputed. Starvation bound: a request of priority p arriving at step t is ranked ahead of every
request of priority q that arrives at or after step t + (p - q) * aging_steps. First come first served
is the same heap keyed by arrival alone.

A sequence keeps its rank for life: preempted, or parked while its tenant holds its share of slots, it
goes back in at its original place. Finished (aborted) sequences stay queued until they reach the head,
where the scheduler skips them: an abort is O(1) however long the queue.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from rayllm.engine.sequence import Sequence


def rank(seq: Sequence) -> tuple[int, int]:
    """A sequence's place in the queue's order (smaller first), fixed when it was first queued."""
    assert seq.rank is not None
    return seq.rank


class WaitQueue:
    def __init__(self, policy: str = "fcfs", aging_steps: int = 1) -> None:
        self.by_priority = policy == "priority"
        self.aging_steps = aging_steps
        self.heap: list[tuple[tuple[int, int], Sequence]] = []
        self.arrivals = 0  # ranks are unique: ties go to the earlier arrival

    def add(self, seq: Sequence, step: int) -> None:
        """A new sequence, arriving at scheduler step `step`."""
        self.arrivals += 1
        key = seq.params.priority * self.aging_steps + step if self.by_priority else step
        seq.rank = (key, self.arrivals)
        self.requeue(seq)

    def requeue(self, seq: Sequence) -> None:
        """A sequence that was taken out (preempted, parked) goes back at its original rank."""
        heapq.heappush(self.heap, (rank(seq), seq))

    def popleft(self) -> Sequence:
        return heapq.heappop(self.heap)[1]

    def __getitem__(self, i: int) -> Sequence:
        if i != 0:
            raise IndexError("only the head of the wait queue can be read")
        return self.heap[0][1]

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self) -> Iterator[Sequence]:
        return (s for _, s in self.heap)
