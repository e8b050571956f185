"""The scheduler's queue of waiting sequences: first come first served, or by priority with aging. No torch.

Priority (vLLM's convention: lower is served first) ages linearly: a request of priority p that arrived
at scheduler step t ranks as if it had priority p - (now - t) / aging_steps. Since every waiting request
ages at the same rate, that order is the static key p * aging_steps + t, so a heap keeps it and no key
is ever recomputed. Starvation bound: a request of priority p arriving at step t is ranked ahead of every
request of priority q that arrives after step t + (p - q) * aging_steps.

Finished (aborted) sequences stay queued until they reach the head, where the scheduler skips them:
an abort is O(1) however long the queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from rayllm.engine.sequence import Sequence


def rank(seq: Sequence) -> tuple[int, int]:
    """A sequence's place in priority order (smaller first), fixed when it was first queued."""
    assert seq.rank is not None
    return seq.rank


class WaitQueue:
    def __init__(self, policy: str = "fcfs", aging_steps: int = 0) -> None:
        self.priority = policy == "priority"
        self.aging_steps = aging_steps
        self.fifo: deque[Sequence] = deque()
        self.heap: list[tuple[tuple[int, int], Sequence]] = []
        self.arrivals = 0  # ties in priority order go to the earlier arrival

    def add(self, seq: Sequence, step: int) -> None:
        """A new sequence, arriving at scheduler step `step`."""
        self.arrivals += 1
        seq.rank = (seq.params.priority * self.aging_steps + step if self.priority else step, self.arrivals)
        self._push(seq, front=False)

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence: FCFS puts it at the front; priority order at its original rank."""
        self._push(seq, front=True)

    def _push(self, seq: Sequence, front: bool) -> None:
        if self.priority:
            heapq.heappush(self.heap, (rank(seq), seq))
        elif front:
            self.fifo.appendleft(seq)
        else:
            self.fifo.append(seq)

    def popleft(self) -> Sequence:
        return heapq.heappop(self.heap)[1] if self.priority else self.fifo.popleft()

    def __getitem__(self, i: int) -> Sequence:
        if i != 0:
            raise IndexError("only the head of the wait queue can be read")
        return self.heap[0][1] if self.priority else self.fifo[0]

    def __len__(self) -> int:
        return len(self.heap) if self.priority else len(self.fifo)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([s for _, s in self.heap] if self.priority else self.fifo)
