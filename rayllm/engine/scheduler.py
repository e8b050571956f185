"""Continuous batching with chunked prefill and preemption by recomputation. No torch.

Every sequence simply has tokens whose KV is not computed yet: a decode step is one such token, a
prefill is many. Each step hands out a token budget: running sequences first (oldest first), then
waiting ones. When blocks run out, the newest running sequence is preempted: its blocks are freed
and it goes back into the queue at its arrival rank (so near the front) to be recomputed (mostly from the prefix cache).
With policy priority the queue is ordered by aged priority (wait_queue.py), running sequences are
served best first and the worst is the one preempted; a queue head that outranks running prefills gets
its prompt's budget before them.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from rayllm.engine.block_manager import BlockManager
from rayllm.engine.sequence import Sequence, SequenceStatus
from rayllm.engine.wait_queue import WaitQueue, rank
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
        self.waiting = WaitQueue(config.policy, config.priority_aging_steps)
        self.num_waiting = 0
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preempted: list[Sequence] = []  # since the engine last took them (it tells the workers)
        self.num_steps = 0  # the clock that priorities age by
        self.by_priority = config.policy == "priority"
        self.tenant_cap = max(1, math.floor(config.max_running_share * config.max_num_seqs))
        self.tenant_running: Counter[str] = Counter()
        # A tenant's sequences that reached the head while it held its share: out of the queue (so they
        # cost nothing per step), back in, best rank first and at their own rank, as its running ones leave.
        self.parked: dict[str, list[tuple[tuple[int, int], Sequence]]] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq, self.num_steps)
        self.num_waiting += 1

    def has_work(self) -> bool:
        return bool(self.num_waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._left_running(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.num_waiting -= 1  # skipped when it reaches the head of the queue
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def _left_running(self, seq: Sequence) -> None:
        tenant = seq.params.tenant
        if tenant is None:
            return
        self.tenant_running[tenant] -= 1
        self._release(tenant)

    def _release(self, tenant: str) -> None:
        """The tenant's best-ranked parked sequence goes back into the queue (aborted ones are dropped)."""
        parked = self.parked.get(tenant)
        while parked:
            s = heapq.heappop(parked)[1]
            if not s.is_finished:  # an aborted one is dropped here (num_waiting already counts it out)
                self.waiting.requeue(s)
                break
        if not parked:
            self.parked.pop(tenant, None)

    def _settle_head(self) -> Sequence | None:
        """The queue's head once aborted heads are dropped and heads whose tenant holds its share are parked
        (None: the queue is empty). A dropped head may be a parked sequence released for a slot: its tenant's
        next one is released in its place, or it would be stranded (one released spare is parked again)."""
        while self.waiting:
            head = self.waiting[0]
            if head.is_finished:
                self.waiting.popleft()
                if head.params.tenant in self.parked:
                    self._release(head.params.tenant)
            elif self._capped(head):
                heapq.heappush(self.parked.setdefault(head.params.tenant, []), (rank(head), self.waiting.popleft()))
            else:
                return head
        return None

    def _capped(self, seq: Sequence) -> bool:
        return seq.params.tenant is not None and self.tenant_running[seq.params.tenant] >= self.tenant_cap

    def _preempt(self, seq: Sequence) -> None:
        self._left_running(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.requeue(seq)
        self.num_waiting += 1
        self.num_preemptions += 1
        self.preempted.append(seq)

    def _preempt_for_head(self) -> None:
        """Priority policy: make room (a slot, the head's blocks) for the head of the queue by preempting
        running sequences of strictly lower priority that also rank after it, worst first; the victims
        queue behind the head, so they cannot take the room back."""
        while self.running:
            head = self._settle_head()  # a capped head must not stop others' preemption for a better head
            if head is None:
                return
            need = -(-head.num_uncomputed_tokens // self.block_manager.block_size)
            if len(self.running) < self.config.max_num_seqs and self.block_manager.num_free_blocks >= need:
                return
            victim = max(self.running, key=rank)
            if victim.params.priority <= head.params.priority or rank(victim) < rank(head):
                return
            self.running.remove(victim)
            self._preempt(victim)

    def _head_reserve(self) -> tuple[tuple[int, int], int] | None:
        """Priority policy: the rank and prompt size of a queue head that has a slot this step and outranks
        a running sequence. Running prefill chunks ranked after it leave it that much of the token budget,
        so a batch's long prompts cannot hold an urgent request's prefill back a step at a time."""
        if not self.running or len(self.running) >= self.config.max_num_seqs:
            return None
        head = self._settle_head()
        if head is None or rank(head) > rank(self.running[-1]):
            return None
        # Its first chunk must fit the free blocks now: else the reserve would hold the running prefills
        # back while the head cannot start either (nothing would move: same priorities preempt nothing).
        chunk = min(head.num_uncomputed_tokens, self.config.max_num_batched_tokens)
        if self.block_manager.num_free_blocks < -(-chunk // self.block_manager.block_size):
            return None
        return rank(head), head.num_uncomputed_tokens

    def _urgent_prompt(self, reserve: tuple[tuple[int, int], int] | None) -> tuple[tuple[int, int], int] | None:
        """Priority policy, prompt_steps_alone: the rank and priority of the best-ranked sequence whose prompt
        is computed this step (running, or the head about to be admitted)."""
        urgent = next(((rank(s), s.params.priority) for s in self.running
                       if s.num_output_tokens == 0 and s.num_uncomputed_tokens > 0), None)
        if reserve is not None:
            head = (reserve[0], self.waiting[0].params.priority)
            urgent = head if urgent is None or head < urgent else urgent
        return urgent

    @staticmethod
    def _sits_out(seq: Sequence, urgent: tuple[tuple[int, int], int] | None) -> bool:
        """Whether `seq` is left out of a step that computes the urgent prompt: it is of strictly lower
        priority and ranks after it (the preemption rule, so the aging bound holds here too)."""
        return urgent is not None and seq.params.priority > urgent[1] and rank(seq) > urgent[0]

    def schedule(self) -> list[ScheduledSeq]:
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        reserve = urgent = None
        if self.by_priority:
            self._preempt_for_head()
            self.running.sort(key=rank)  # best first, so pop() below preempts the worst
            reserve = self._head_reserve()
            if self.config.prompt_steps_alone:
                urgent = self._urgent_prompt(reserve)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._sits_out(seq, urgent):  # keeps its blocks, runs again next step
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if reserve is not None and n > 1 and rank(seq) > reserve[0]:  # decodes (one token) always run
                n = min(n, budget - reserve[1])
                if n < 1:
                    i += 1
                    continue
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
        while budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self._settle_head()
            if seq is None:
                break
            if self._sits_out(seq, urgent):
                break
            if not seq.block_table:
                # Prompt logprobs and mean pooling need every prompt position computed: they skip the cache.
                if seq.params.prompt_logprobs is None and seq.pooling != "mean":
                    self.block_manager.match_prefix(seq)
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
            if seq.num_cached_tokens < 0:  # its first admission: a failed one above freed the prefix it matched
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            # Registered now, so the next waiting request can share these blocks in this same step.
            self.block_manager.commit_full_blocks(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.params.tenant is not None:
                self.tenant_running[seq.params.tenant] += 1
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled
