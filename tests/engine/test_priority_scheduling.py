"""Priority order, aging (the starvation bound), preemption by priority and per-tenant shares, on the
real block manager (no torch, no model)."""

from __future__ import annotations

import zlib

import pytest

from rayllm.engine.block_manager import BlockManager
from rayllm.engine.scheduler import Scheduler
from rayllm.engine.sequence import Sequence, SequenceStatus
from rayllm.schema.config import SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams


def seq(rid: str, n: int = 3, priority: int = 0, tenant: str | None = None) -> Sequence:
    # Distinct prompts, no prefix sharing between requests: a disjoint token range per id (not `hash`,
    # which is salted per process and let ranges overlap on some runs).
    toks = [zlib.crc32(rid.encode()) % 100_000 * 1_000 + i for i in range(n)]
    return Sequence(rid, toks, n, SamplingParams(max_tokens=4, priority=priority, tenant=tenant))


def sched(**kw) -> Scheduler:
    blocks = kw.pop("num_blocks", 256)
    return Scheduler(SchedulerConfig(**{"max_num_seqs": 1, "max_num_batched_tokens": 64, **kw}),
                     BlockManager(num_blocks=blocks, block_size=4))


def admission_order(s: Scheduler) -> list[str]:
    """Ids in the order the queue is admitted, one step at a time (each finishes at once, and so does
    whatever was running before)."""
    for x in list(s.running):
        s.finish(x, "stop")
    order: list[str] = []
    while s.num_waiting:
        step = s.schedule()
        assert step, "waiting work but nothing scheduled"
        for sc in step:
            order.append(sc.seq.request_id)
            s.finish(sc.seq, "stop")
    return order


def test_fcfs_ignores_priority():
    s = sched()
    for rid, p in [("a", 5), ("b", -5), ("c", 0)]:
        s.add(seq(rid, priority=p))
    assert admission_order(s) == ["a", "b", "c"]


def test_priority_orders_lower_first_and_ties_by_arrival():
    s = sched(policy="priority")
    for rid, p in [("a", 5), ("b", -5), ("c", 0), ("d", -5), ("e", 0)]:
        s.add(seq(rid, priority=p))
    assert admission_order(s) == ["b", "d", "c", "e", "a"]


def test_aging_bound_low_priority_goes_ahead_of_requests_arriving_after_the_bound():
    """A priority-2 request arriving at step t outranks priority-0 requests arriving after step
    t + (2 - 0) * aging_steps, and is outranked by those arriving before (the bound is tight)."""
    aging = 5
    s = sched(policy="priority", priority_aging_steps=aging)
    hog = seq("hog", n=3)
    s.add(hog)
    s.schedule()  # hog holds the only slot; steps go by while the queue builds up
    low = seq("low", priority=2)
    s.add(low)
    t = s.num_steps
    arrivals: list[tuple[str, int]] = []
    for i in range(3 * aging):
        s.add(seq(f"hi{i}", priority=0))
        arrivals.append((f"hi{i}", s.num_steps))
        s.schedule()
    s.finish(hog, "stop")
    order = admission_order(s)
    before = [rid for rid, step in arrivals if step < t + 2 * aging]
    after = [rid for rid, step in arrivals if step >= t + 2 * aging]
    assert before and after
    assert order == before + ["low"] + after


def test_memory_pressure_preempts_the_lowest_priority_first():
    # 3 sequences of 8-token prompts = 2 blocks each; 6 blocks: the first decode token needs a 7th.
    s = sched(policy="priority", max_num_seqs=3, num_blocks=6)
    seqs = [seq("mid", 8, 0), seq("low", 8, 3), seq("high", 8, -3)]
    for x in seqs:
        s.add(x)
    assert {sc.seq.request_id for sc in s.schedule()} == {"mid", "low", "high"}
    for x in seqs:
        x.num_computed_tokens = 8
        x.token_ids.append(1)  # each sampled a token: the next step needs a new block apiece
    step = {sc.seq.request_id for sc in s.schedule()}
    assert step == {"high", "mid"} and seqs[1].status is SequenceStatus.WAITING and s.num_preemptions == 1


def test_fcfs_memory_pressure_preempts_the_newest():
    s = sched(max_num_seqs=3, num_blocks=6)
    seqs = [seq("a", 8, 0), seq("b", 8, 3), seq("c", 8, -3)]
    for x in seqs:
        s.add(x)
    s.schedule()
    for x in seqs:
        x.num_computed_tokens = 8
        x.token_ids.append(1)
    assert {sc.seq.request_id for sc in s.schedule()} == {"a", "b"}


def test_a_higher_priority_arrival_preempts_a_lower_running_one_not_the_reverse():
    s = sched(policy="priority", max_num_seqs=2)
    batch = [seq("b0", priority=1), seq("b1", priority=1)]
    for x in batch:
        s.add(x)
    s.schedule()
    s.add(seq("eq", priority=1))  # equal priority: waits for a slot
    s.schedule()
    assert s.num_preemptions == 0
    s.add(urgent := seq("urgent", priority=-1))
    step = {sc.seq.request_id for sc in s.schedule()}
    assert "urgent" in step and urgent.status is SequenceStatus.RUNNING
    assert s.num_preemptions == 1 and batch[1].status is SequenceStatus.WAITING  # the later of the two
    for _ in range(5):  # the victim queues behind: no ping-pong
        s.schedule()
    assert s.num_preemptions == 1 and urgent.status is SequenceStatus.RUNNING


def test_aged_request_is_not_preempted_by_a_much_later_higher_priority_one():
    s = sched(policy="priority", max_num_seqs=1, priority_aging_steps=2)
    s.add(old := seq("old", priority=1))
    s.schedule()
    for _ in range(10):
        s.schedule()
    s.add(seq("new", priority=0))  # ranks after `old` (1 * 2 + 1 < 0 * 2 + 12)
    s.schedule()
    assert old.status is SequenceStatus.RUNNING and s.num_preemptions == 0


def computed(step) -> dict[str, int]:
    """What the engine does after a step: the scheduled tokens are computed, and a chunk that reaches the
    end samples a token. Returns tokens per id."""
    for sc in step:
        if sc.samples:
            sc.seq.token_ids.append(7)
        sc.seq.num_computed_tokens += sc.num_tokens
    return {sc.seq.request_id: sc.num_tokens for sc in step}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_urgent_prompt_gets_the_budget_before_a_running_batch_prefill(policy):
    """A batch prompt (200 tokens, chunked 64 a step) is mid-prefill when an urgent one arrives. With
    priority the urgent prompt is computed in the next step, the batch chunk takes what is left, and a
    running batch decode still gets its token; fcfs serves the running prefill first. The token budget's
    reserve alone: `prompt_steps_alone` (on by default) would leave the lower-priority rows out of that step
    (the next test)."""
    s = sched(policy=policy, max_num_seqs=4, prompt_steps_alone=False)
    s.add(seq("dec", n=4, priority=1))
    assert computed(s.schedule()) == {"dec": 4}  # then one token to decode per step
    s.add(seq("batch", n=200, priority=1))
    assert computed(s.schedule()) == {"dec": 1, "batch": 63}
    s.add(seq("urgent", n=20, priority=0))
    got = computed(s.schedule())
    assert got == ({"dec": 1, "batch": 43, "urgent": 20} if policy == "priority" else {"dec": 1, "batch": 63})
    s.add(seq("big", n=100, priority=-1))  # more than the budget: the batch chunk waits a step, the decodes not
    got = computed(s.schedule())
    if policy == "priority":
        assert got == {"urgent": 1, "dec": 1, "big": 62}
    s.add(seq("late", n=20, priority=1))  # same priority as the batch, later: no reserve
    got = computed(s.schedule())
    assert got["batch"] > 0 and "late" not in got


def test_an_urgent_prompt_step_leaves_out_what_it_outranks_within_the_aging_bound():
    """prompt_steps_alone: the step that computes an urgent prompt leaves out the running sequences of lower
    priority that rank after it (decodes and queued prompts alike); they keep their blocks and run in the
    next step, beside the urgent one's decode. A request running for longer than the aging bound is not
    left out."""
    aging = 10
    s = sched(policy="priority", max_num_seqs=8, priority_aging_steps=aging, prompt_steps_alone=True)
    s.add(old := seq("old", n=4, priority=1))
    computed(s.schedule())
    for _ in range(aging):  # `old` decodes for aging steps: past the bound for what arrives from now on
        computed(s.schedule())
    s.add(seq("b0", n=4, priority=1))
    s.add(b1 := seq("b1", n=4, priority=1))
    assert computed(s.schedule()) == {"old": 1, "b0": 4, "b1": 4}
    blocks = list(b1.block_table)
    s.add(seq("urgent", n=20, priority=0))
    s.add(seq("b2", n=4, priority=1))  # queued behind the urgent one: not in its step either
    assert computed(s.schedule()) == {"old": 1, "urgent": 20}  # old ranks ahead: 1 * 10 + 0 < 0 * 10 + 12
    assert b1.block_table == blocks and b1.status is SequenceStatus.RUNNING and s.num_preemptions == 0
    assert computed(s.schedule()) == {"old": 1, "urgent": 1, "b0": 1, "b1": 1, "b2": 4}
    s.add(seq("same", n=4, priority=1))  # equal priority: an ordinary step
    assert computed(s.schedule()) == {"old": 1, "urgent": 1, "b0": 1, "b1": 1, "b2": 1, "same": 4}
    assert old.status is SequenceStatus.RUNNING


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_tenant_holds_at_most_its_share_of_slots(policy):
    s = sched(policy=policy, max_num_seqs=4, max_running_share=0.5)
    flood = [seq(f"a{i}", tenant="A") for i in range(20)]
    for x in flood:
        s.add(x)
    s.add(seq("b", tenant="B"))
    s.add(seq("anon"))  # no tenant (keys off): never capped
    s.schedule()
    running = {x.request_id for x in s.running}
    assert running == {"a0", "a1", "b", "anon"}
    s.finish(flood[0], "stop")
    s.schedule()
    assert {x.request_id for x in s.running} == {"a1", "a2", "b", "anon"}  # A's next, in order
    s.finish(flood[5], "abort")  # aborted while parked: dropped, never run
    order = admission_order(s)
    assert "a5" not in order and order == [f"a{i}" for i in range(3, 20) if i != 5]
    assert not s.parked and s.num_waiting == 0


def test_one_tenant_alone_gets_its_share_and_the_queue_drains():
    s = sched(max_num_seqs=4, max_running_share=0.25)
    for i in range(6):
        s.add(seq(f"a{i}", tenant="A"))
    s.schedule()
    assert len(s.running) == 1
    assert admission_order(s) == [f"a{i}" for i in range(1, 6)]


def run_until(s: Scheduler, rid: str, steps: int = 50) -> int:
    """Steps (each computing what it schedules; a sequence ends after 4 new tokens) until `rid` is scheduled."""
    for k in range(1, steps + 1):
        step = s.schedule()
        assert step or not s.has_work(), "work waits but nothing is scheduled (the engine would spin)"
        got = computed(step)
        if rid in got:
            return k
        for x in list(s.running):
            if x.num_output_tokens >= 4:
                s.finish(x, "length")
    raise AssertionError(f"{rid} not scheduled in {steps} steps")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_released_sequence_aborted_in_the_queue_passes_its_slot_on(policy):
    """Tenant A at its share (1): s1 and s2 park. r leaves, so s1 goes back into the queue; its client leaves
    before it runs. s2 must get the slot (it was stranded: nothing ran, the engine spun on `has_work`)."""
    s = sched(policy=policy, max_num_seqs=4, max_running_share=0.25)
    r, s1, s2 = seq("r", tenant="A"), seq("s1", tenant="A"), seq("s2", tenant="A")
    for x in (r, s1, s2):
        s.add(x)
    computed(s.schedule())
    assert [x.request_id for x in s.running] == ["r"] and len(s.parked["A"]) == 2
    s.finish(r, "stop")
    s.finish(s1, "abort")
    assert run_until(s, "s2") == 1


def test_parked_sequences_come_back_in_rank_order():
    """A tenant's urgent request parked behind its own flex ones comes back first: at its own rank."""
    s = sched(policy="priority", max_num_seqs=4, max_running_share=0.25)
    s.add(first := seq("first", tenant="A", priority=1))
    computed(s.schedule())
    for i in range(3):
        s.add(seq(f"flex{i}", tenant="A", priority=1))
    s.add(seq("urgent", tenant="A", priority=-5))
    computed(s.schedule())  # all four park: A holds its one slot
    s.finish(first, "stop")
    assert admission_order(s) == ["urgent", "flex0", "flex1", "flex2"]


def test_a_capped_head_does_not_stop_preemption_for_the_next_urgent_request():
    """Four slots, share 0.5: A runs two urgent requests, B two flex ones. A's third reaches the head (capped);
    C's urgent request behind it still preempts a flex one at once, not after a flex one ends."""
    s = sched(policy="priority", max_num_seqs=4, max_running_share=0.5)
    for rid, tenant, p in [("a0", "A", -1), ("a1", "A", -1), ("b0", "B", 1), ("b1", "B", 1)]:
        s.add(seq(rid, n=4, tenant=tenant, priority=p))
    computed(s.schedule())
    s.add(seq("a2", n=4, tenant="A", priority=-1))
    s.add(seq("u", n=4, tenant="C", priority=-1))
    assert "u" in computed(s.schedule()) and s.num_preemptions == 1


def test_a_head_whose_prompt_cannot_be_placed_leaves_the_running_prefill_its_budget():
    """A's h (64 tokens, the whole step budget) was parked behind A's x, so it ranks before B's running
    prefill p, of the same priority: nothing preempts p, and h's 16 blocks are not free. The budget reserved
    for h held p's chunks back while h could not start either: no step ever ran. Now p finishes its prompt
    and decodes, its blocks come back, and h runs."""
    s = sched(policy="priority", max_num_seqs=4, max_running_share=0.25, num_blocks=24)
    s.add(x := seq("x", n=3, tenant="A"))
    s.add(seq("h", n=64, tenant="A"))
    computed(s.schedule())  # x runs, h parks
    s.add(seq("p", n=80, tenant="B"))
    computed(s.schedule())  # p's first chunk: 63 tokens, 16 blocks of 24
    s.finish(x, "stop")  # h is back in the queue, ahead of p
    assert run_until(s, "h") > 1


def test_config_checks():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="max_running_share"):
        SchedulerConfig(max_running_share=0)
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=10**7)
