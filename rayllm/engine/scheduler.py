"""Continuous batching with chunked prefill and preemption by recomputation. No torch.

Every sequence simply has tokens whose KV is not computed yet: a decode step is one such token, a
prefill is many. Each step hands out a token budget: running sequences first (oldest first), then
waiting ones. When blocks run out, the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the queue to be recomputed (mostly from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rayllm.engine.block_manager import BlockManager
from rayllm.engine.sequence import Sequence, SequenceStatus
from rayllm.schema.config import SchedulerConfig


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a new token is sampled (never for a
        pooling sequence, which only prefills)."""
        return self.seq.pooling is None and self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        # Finished (aborted) sequences stay in `waiting` until they reach its head, where they are skipped:
        # an abort is O(1) however long the queue (deque.remove would make aborting a fan-out quadratic).
        self.waiting: deque[Sequence] = deque()
        self.num_waiting = 0
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.num_waiting += 1

    def has_work(self) -> bool:
        return bool(self.num_waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.num_waiting -= 1  # skipped when it reaches the head of the queue
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_waiting += 1
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.commit_full_blocks(seq, seq.num_computed_tokens + n)
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        # Admitting new work while we had to preempt would only thrash.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.is_finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            if not seq.block_table:
                # Prompt logprobs and mean pooling need every prompt position computed: they skip the cache.
                full = seq.params.prompt_logprobs is not None or seq.pooling == "mean"
                cached = 0 if full else self.block_manager.match_prefix(seq)
                if seq.num_cached_tokens < 0:
                    seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, n):
                if not self.running:
                    # Nothing will ever free blocks for it: the request cannot fit the cache at all.
                    self.waiting.popleft()
                    self.num_waiting -= 1
                    self.block_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "length" if seq.num_output_tokens else "abort"
                    scheduled.append(ScheduledSeq(seq, 0))
                else:
                    self.block_manager.free(seq)
                break
            self.waiting.popleft()
            self.num_waiting -= 1
            # Registered now, so the next waiting request can share these blocks in this same step.
            self.block_manager.commit_full_blocks(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled
