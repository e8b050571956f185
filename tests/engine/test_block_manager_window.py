"""Block accounting of sliding-window models: blocks behind every layer's window go back to the pool.

No torch or model: the scheduler drives a BlockManager as the engine does, and each step's tokens
are marked computed (and a token appended when the chunk samples), so the block tables the model
runner would see can be checked directly.
"""

from __future__ import annotations

from rayllm.engine.block_manager import FREED, BlockManager
from rayllm.engine.scheduler import Scheduler
from rayllm.engine.sequence import Sequence
from rayllm.schema.config import SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams

BS, WINDOW, BUDGET = 4, 8, 16


def seq(rid: str, tokens: list[int], max_tokens: int) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(sched: Scheduler, check=None) -> None:
    """One engine step without a model: the scheduled tokens are computed, samplers get token 7."""
    for sc in sched.schedule():
        if check is not None:
            check(sc.seq, sc.num_tokens)
        sc.seq.num_computed_tokens += sc.num_tokens
        if sc.samples:
            sc.seq.token_ids.append(7)
            if sc.seq.num_output_tokens >= sc.seq.params.max_tokens:
                sched.finish(sc.seq, "length")


def live(s: Sequence) -> list[int]:
    return [b for b in s.block_table if b != FREED]


def check_window_kept(s: Sequence, n: int) -> None:
    """Every position a query of this step can see is in a live block; everything before it is freed."""
    c, table = s.num_computed_tokens, s.block_table
    first_visible = max(0, c - WINDOW + 1)
    assert all(b != FREED for b in table[first_visible // BS :])
    assert all(b == FREED for b in table[: first_visible // BS])
    assert len(table) == -(-(c + n) // BS)  # positions keep their indices: one entry per block of the sequence


def test_blocks_behind_the_window_go_back_to_the_pool():
    """80 tokens need 20 blocks; with an 8-token window the sequence never holds more than a few, so a
    cache of 8 blocks serves it to the end."""
    bm = BlockManager(num_blocks=8, block_size=BS, window=WINDOW)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET), bm)
    a = seq("a", list(range(100, 120)), max_tokens=60)
    sched.add(a)
    bound = bm.max_blocks_held(80, BUDGET)
    assert bound < 8 < -(-80 // BS)
    held = []
    while sched.has_work():
        run_step(sched, check_window_kept)
        held.append(8 - bm.num_free_blocks)
        assert len(live(a)) <= bound
    assert a.num_tokens == 80 and a.finish_reason == "length"
    # Decoding holds the window's blocks and the one being written: 8 tokens span at most 3 blocks.
    assert max(held[-50:]) <= 3
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_without_a_window_every_block_is_kept():
    """A model with any global layer (Gemma 2/3 interleave them): kv_window is None, nothing is freed."""
    bm = BlockManager(num_blocks=32, block_size=BS, window=None)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET), bm)
    a = seq("a", list(range(100, 120)), max_tokens=40)
    sched.add(a)
    while a.num_output_tokens < 39:
        run_step(sched)
    assert FREED not in a.block_table
    assert 32 - bm.num_free_blocks == len(a.block_table) == -(-a.num_tokens // BS)
    assert bm.max_blocks_held(80, BUDGET) == 20


def test_freed_blocks_stay_in_the_prefix_cache_for_later_requests():
    """A windowed sequence's full blocks are hashed before they are freed; a later request with the same
    prompt reuses them, then drops the ones behind its own window. No block is released twice."""
    bm = BlockManager(num_blocks=16, block_size=BS, window=WINDOW)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET), bm)
    prompt = list(range(100, 124))
    a = seq("a", prompt, max_tokens=10)
    sched.add(a)
    while a.num_output_tokens < 5:
        run_step(sched)
    first_blocks = list(bm.hash_to_block.values())[:3]
    assert a.block_table[:3] == [FREED] * 3
    assert all(bm.blocks[b].ref_count == 0 and b in bm.free_blocks for b in first_blocks)
    b = seq("b", prompt, max_tokens=3)
    assert bm.match_prefix(b) == 20  # five full blocks; the last prompt token is computed again
    assert b.block_table[:3] == first_blocks
    assert bm.allocate_slots(b, b.num_uncomputed_tokens)
    assert b.block_table[:3] == [FREED] * 3  # behind b's window too: straight back to the pool
    assert all(bm.blocks[i].ref_count == 0 for i in first_blocks)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_a_block_shared_with_a_slower_sequence_stays_allocated():
    """Dropping a block another sequence still reads only lowers its reference count."""
    bm = BlockManager(num_blocks=16, block_size=BS, window=WINDOW)
    prompt = list(range(100, 113))
    a, b = seq("a", prompt, 30), seq("b", prompt, 30)
    assert bm.allocate_slots(a, 13)
    bm.commit_full_blocks(a, 13)
    a.num_computed_tokens = 13
    assert bm.match_prefix(b) == 12  # b shares a's three full blocks and has computed none past them
    a.token_ids += [7] * 8
    a.num_computed_tokens = 21
    b.num_computed_tokens = 4
    assert bm.allocate_slots(a, 1) and bm.allocate_slots(b, 1)
    assert a.block_table[:3] == [FREED] * 3 and FREED not in b.block_table
    assert all(bm.blocks[i].ref_count == 1 and i not in bm.free_blocks for i in b.block_table[:3])
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 16


def test_preempted_windowed_sequence_releases_only_its_live_blocks():
    """Two windowed sequences in 6 blocks: one is preempted while it holds FREED entries."""
    bm = BlockManager(num_blocks=6, block_size=BS, window=WINDOW)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET), bm)
    a, b = seq("a", list(range(100, 120)), 40), seq("b", list(range(200, 220)), 40)
    sched.add(a)
    sched.add(b)
    while sched.has_work() and sched.num_preemptions == 0:
        before = {s.request_id: list(s.block_table) for s in (a, b)}
        run_step(sched, check_window_kept)
        assert sum(blk.ref_count for blk in bm.blocks) == 6 - bm.num_free_blocks
    assert sched.num_preemptions == 1
    victim = b if b.status.value == "waiting" else a
    assert FREED in before[victim.request_id]
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    while sched.has_work():
        run_step(sched, check_window_kept)
    assert a.num_output_tokens == b.num_output_tokens == 40
    assert bm.num_free_blocks == 6 and all(blk.ref_count == 0 for blk in bm.blocks)
