"""A CPU step in two halves on two threads, one torch thread each.

With one torch thread per rank (what leaves a core to the serving processes), a large batch can still
use a second core without OpenMP: the step's sequences are cut in two, and each half runs the whole
model (its own GEMMs, attention and LM head rows) on its own thread; torch ops release the GIL. The
halves meet once, at the end of the step, instead of at a barrier after every op, so a core that a
serving process takes for a while delays one half, not every op of the step. Every sequence's rows
are computed by the same row-wise kernels as in the whole step, except in layers with a small-batch copy
(SmallBatchMethod), which pick their kernel by the half's row count: there a row can round differently
(docs/cpu.md, "The second core").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from rayllm.platforms.cpu import qgemm
from rayllm.platforms.cpu.onednn import OneDNNWeight

if TYPE_CHECKING:
    from rayllm.schema.step import SeqStep


def split_point(seqs: Sequence[SeqStep], block_size: int, min_tokens: int) -> int:
    """Where to cut a step's sequences into two halves of about equal tokens (0: run it whole).

    0 when a half would get fewer than `min_tokens / 2` tokens (a few decodes beside a prompt's chunk
    measured slower in halves than whole: docs/benchmarks.md); when an adapter is in the batch (the
    LoRA batch state is one per step); or when one half writes a block that the other reads: a request
    admitted in this step may attend to prefix blocks another request is filling in it
    (block_manager.py), which within one forward is safe only because every layer writes before any
    query attends.
    """
    tokens = [len(s.token_ids) for s in seqs]
    total = sum(tokens)
    if len(seqs) < 2 or total < min_tokens or any(s.lora_slot for s in seqs):
        return 0
    cut, acc = 0, 0
    while cut < len(seqs) - 1 and 2 * (acc + tokens[cut]) <= total:
        acc += tokens[cut]
        cut += 1
    if 2 * min(acc, total - acc) < min_tokens:  # a small half (beside a long prompt's chunk) gains nothing
        return 0
    first, second = seqs[:cut], seqs[cut:]
    if _crosses(first, second, block_size) or _crosses(second, first, block_size):
        return 0
    return cut


def _crosses(writers: Sequence[SeqStep], readers: Sequence[SeqStep], block_size: int) -> bool:
    """Does any of `readers` attend to a block that one of `writers` fills in this step?"""
    written: set[int] = set()
    for s in writers:
        end = s.start_pos + len(s.token_ids)
        written.update(s.block_table[s.start_pos // block_size : -(-end // block_size)])
    return any(not written.isdisjoint(s.block_table[: -(-(s.start_pos + len(s.token_ids)) // block_size)])
               for s in readers)


class HalfThread:
    """The second half's thread (one torch thread, inference mode), kept for the engine's life."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="half-step", initializer=torch.set_num_threads,
                                        initargs=(1,))
        self.idle = True  # False while a step runs in halves: then each half's LM head runs on its own thread
        self.steps = 0  # steps run in halves, for stats and tests
        self.lm_head_calls = 0  # LM head calls split over the vocabulary (VocabHalves)

    @contextmanager
    def running(self) -> Iterator[None]:
        """While a step runs in halves: each half's kernels stay on its own thread (no LM head split, no
        GEMM pool), since each half already holds a core."""
        self.idle, qgemm.POOL.paused = False, True
        try:
            yield
        finally:
            self.idle, qgemm.POOL.paused = True, False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(_inference, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _inference(fn: Callable[..., Any], *args: Any) -> Any:
    with torch.inference_mode():
        return fn(*args)


class VocabHalves:
    """The LM head's oneDNN weight as two halves of the vocabulary. In a step that runs whole on one torch
    thread, the two halves run at once, on this thread and the half thread: the LM head is the step's
    largest GEMM, each thread reads half its weight, and the step meets the other thread once more.
    Each logit is the same dot product as in one call (bit-equal in the tests). A weight method, as OneDNNWeight."""

    all_batches = False

    def __init__(self, weight: torch.Tensor, thread: HalfThread) -> None:
        n = weight.shape[0] // 2
        self.parts = (OneDNNWeight(weight[:n].contiguous()), OneDNNWeight(weight[n:].contiguous()))
        self.thread = thread

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        first, second = self.parts
        if self.thread.idle and torch.get_num_threads() == 1:
            self.thread.lm_head_calls += 1
            later = self.thread.submit(second, x, bias)
            return torch.cat([first(x, bias), later.result()], dim=-1)
        return torch.cat([first(x, bias), second(x, bias)], dim=-1)

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return self(x, layer.bias)
