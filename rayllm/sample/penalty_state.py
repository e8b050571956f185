"""The driver's penalty state, kept across steps so that a penalised sequence costs O(1) per step, not
O(its length): per sequence, which tokens its prompt and output hold (`seen`, for the repetition penalty)
and how often each occurs in its output (`counts`, for frequency and presence), as one row of two
[slots, V] tensors on the logits' device (vLLM keeps its output-token counts on the worker likewise).

The engine sends each step only the tokens a sequence gained since its previous sample (SeqStep.history,
from position history_start); history_start 0 (its first sample, or its first after a preemption, when
the engine has the driver drop its row) rebuilds the row from the whole history. Row 0 stays zero: it is
the row of every sequence without penalties in a batch. Only rank 0 samples, so only rank 0 holds any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (host list, dtype, device) -> a tensor on the device (sampling_inputs.to_device: pinned on CUDA)
Upload = Callable[[list, torch.dtype, torch.device], torch.Tensor]


@dataclass
class PenaltyUpdate:
    """A sequence's tokens at positions start.. (the prompt is its first num_prompt positions)."""

    request_id: str
    start: int
    tokens: list[int]
    num_prompt: int
    done: bool = False  # applied (a batch redone row by row must not count its tokens twice)


class PenaltyState:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None  # [slots, V] bool
        self.counts: torch.Tensor | None = None  # [slots, V] float32: exact integers, as index_add of ones
        self.slots: dict[str, int] = {}
        self.lengths: dict[str, int] = {}  # tokens of the sequence the row holds
        self.free: list[int] = []

    def check(self, u: PenaltyUpdate) -> None:
        """The step's tokens must start where the row ends (a sequence's own fault otherwise)."""
        if u.start and self.lengths.get(u.request_id) != u.start:
            raise ValueError(f"penalty state out of step: it holds {self.lengths.get(u.request_id, 0)} tokens of "
                             f"this sequence, the step's start at position {u.start}")

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self.free.append(slot)
                del self.lengths[rid]
        if not self.slots and self.seen is not None:  # no penalised sequence left: give the memory back
            self.seen = self.counts = None
            self.free = []

    def _reserve(self, needed: int, device: torch.device) -> None:
        """Room for `needed` more rows (a copy into tensors twice as tall when full; row 0 is the zero row)."""
        used = len(self.slots) + 1
        cap = 0 if self.seen is None else self.seen.shape[0]
        if used + needed <= cap:
            return
        rows = max(2 * cap, used + needed, 8)
        seen = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=device)
        counts = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=device)
        if self.seen is not None and self.counts is not None:
            seen[:cap].copy_(self.seen)
            counts[:cap].copy_(self.counts)
        self.free += range(max(cap, 1), rows)
        self.seen, self.counts = seen, counts

    def update(self, updates: list[PenaltyUpdate], device: torch.device, upload: Upload) -> None:
        """Add the updates' tokens, all sequences in one scatter each (rows taken or rebuilt are zeroed first)."""
        updates = [u for u in updates if not u.done]
        if not updates:
            return
        for u in updates:
            self.check(u)
        self._reserve(sum(u.request_id not in self.slots for u in updates), device)
        assert self.seen is not None and self.counts is not None
        rebuilt = []
        for u in updates:
            if u.request_id not in self.slots:
                self.slots[u.request_id] = self.free.pop()
                rebuilt.append(self.slots[u.request_id])
            elif u.start == 0:
                rebuilt.append(self.slots[u.request_id])
        v = self.vocab_size
        seen_idx: list[int] = []
        out_idx: list[int] = []
        for u in updates:
            base = self.slots[u.request_id] * v
            seen_idx += [base + t for t in u.tokens]
            out_idx += [base + t for t in u.tokens[max(u.num_prompt - u.start, 0):]]
        flat = upload(rebuilt + seen_idx + out_idx, torch.long, device)
        if rebuilt:
            rows = flat.narrow(0, 0, len(rebuilt))
            self.seen.index_fill_(0, rows, False)
            self.counts.index_fill_(0, rows, 0.0)
        self.seen.view(-1).index_fill_(0, flat.narrow(0, len(rebuilt), len(seen_idx)), True)
        outs = flat.narrow(0, len(rebuilt) + len(seen_idx), len(out_idx))
        self.counts.view(-1).index_add_(0, outs, torch.ones(len(out_idx), dtype=torch.float32, device=device))
        for u in updates:
            self.lengths[u.request_id] = u.start + len(u.tokens)
            u.done = True

    def rows(self, request_ids: list[str | None], device: torch.device,
             upload: Upload) -> tuple[torch.Tensor, torch.Tensor]:
        """[len(request_ids), V] seen and counts, a None id's row zero."""
        assert self.seen is not None and self.counts is not None
        index = upload([0 if rid is None else self.slots[rid] for rid in request_ids], torch.long, device)
        return self.seen.index_select(0, index), self.counts.index_select(0, index)
