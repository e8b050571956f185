"""Scheduler queues: aborting waiting (and preempted) sequences, without torch or a model."""

from __future__ import annotations

import random

from rayllm.engine.block_manager import BlockManager
from rayllm.engine.scheduler import Scheduler
from rayllm.engine.sequence import Sequence, SequenceStatus
from rayllm.schema.config import SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=4))


def admitted(sched: Scheduler) -> list[str]:
    """Request ids in the order the scheduler admits them, one step at a time until the queue is empty."""
    order: list[str] = []
    while sched.num_waiting:
        step = sched.schedule()
        assert step, "waiting work but nothing scheduled"
        for sc in step:
            order.append(sc.seq.request_id)
            sched.finish(sc.seq, "stop")  # make room for the next ones
    return order


def test_sequences_compare_by_identity():
    a, b = seq("x", [1, 2, 3]), seq("x", [1, 2, 3])
    assert a == a and a != b  # same fields, different requests
    assert Sequence.__eq__ is object.__eq__ and hash(a) != hash(b)


def test_aborting_thousands_of_waiting_sequences_keeps_fifo_order_of_the_rest():
    """A fan-out request (500 prompts x n=16) queued, then half of it aborted in random order."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64), bm)
    seqs = [seq(f"r{i}", [i % 50, 1, 2]) for i in range(8000)]
    for s in seqs:
        sched.add(s)
    assert sched.num_waiting == 8000 and sched.has_work()
    doomed = random.Random(0).sample(seqs, 4000)
    for s in doomed:
        sched.finish(s, "abort")
        assert s.status is SequenceStatus.FINISHED and s.finish_reason == "abort"
    assert sched.num_waiting == 4000
    doomed_ids = {s.request_id for s in doomed}
    assert admitted(sched) == [s.request_id for s in seqs if s.request_id not in doomed_ids]
    assert not sched.has_work() and not sched.waiting and bm.num_free_blocks == 64


def test_aborting_every_waiting_sequence_leaves_no_work():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), bm)
    seqs = [seq(f"r{i}", [1, 2]) for i in range(8000)]
    for s in seqs:
        sched.add(s)
    for s in reversed(seqs):
        sched.finish(s, "abort")
    assert not sched.has_work() and sched.num_waiting == 0
    assert sched.schedule() == [] and not sched.waiting  # the skipped entries are dropped


def test_a_preempted_sequence_can_be_aborted_while_it_waits():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), bm)
    a, b = seq("a", list(range(8))), seq("b", list(range(20, 28)))
    sched.add(a)
    sched.add(b)
    sched.schedule()
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(1)  # each needs a third block: only 4 exist, so the newest (b) is preempted
    step = sched.schedule()
    assert [sc.seq.request_id for sc in step] == ["a"] and sched.num_preemptions == 1
    assert sched.waiting[0] is b and sched.num_waiting == 1
    sched.finish(b, "abort")
    assert sched.num_waiting == 0
    sched.finish(a, "stop")
    assert not sched.has_work() and bm.num_free_blocks == 4


def run_step(sched: Scheduler, max_tokens: dict[str, int]) -> list[tuple[Sequence, int]]:
    """One step as the engine records it: the chunks computed, a token sampled at each sequence's end, and
    the sequences at their max_tokens finished. Returns each scheduled sequence with its tokens computed before."""
    scheduled = []
    for sc in sched.schedule():
        s, samples = sc.seq, sc.samples
        scheduled.append((s, s.num_computed_tokens))
        s.num_computed_tokens += sc.num_tokens
        if samples:
            s.token_ids.append(99)
            if s.num_output_tokens >= max_tokens[s.request_id]:
                sched.finish(s, "length")
    return scheduled


def test_cached_tokens_are_those_of_the_admission_that_succeeded():
    """A request matches a cached prefix but cannot get its other blocks; while it waits, a running one's growth
    evicts that prefix. It is admitted with nothing cached and must report 0, not the first match's 8."""
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
    limits = {"warm": 1, "hit": 1, "R": 35, "H": 1}
    sched.add(seq("warm", prefix + [13]))
    while sched.has_work():
        run_step(sched, limits)
    hit = seq("hit", prefix + [14])
    sched.add(hit)
    while sched.has_work():
        run_step(sched, limits)
    assert hit.num_cached_tokens == 8  # the prefix, reused at once
    sched.add(seq("R", [20, 21, 22, 23, 24]))  # grows to 40 tokens: every block
    run_step(sched, limits)
    late = seq("H", prefix + list(range(25, 53)))  # 9 blocks: 2 cached + 7 more never free while R runs
    sched.add(late)
    run_step(sched, limits)
    assert bm.prefix_hits == 8 + 8 and late.num_computed_tokens == 0  # its prefix matched, its admission failed
    while sched.has_work():
        for s, before in run_step(sched, limits):
            assert s is not late or before == 0  # computed from scratch: the prefix was evicted meanwhile
    assert late.finish_reason == "length" and late.num_cached_tokens == 0
