"""Block manager and scheduler logic, without torch or a model."""

from __future__ import annotations

from rayllm.engine.block_manager import BlockManager
from rayllm.engine.scheduler import Scheduler
from rayllm.engine.sequence import Sequence
from rayllm.schema.config import SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams


def seq(rid: str, tokens: list[int], max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens))


def test_prefix_blocks_are_shared_and_survive_free_until_evicted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))
    assert bm.match_prefix(a) == 0
    assert bm.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.commit_full_blocks(a, a.num_computed_tokens)  # blocks 0 and 1 are full and hashed; the third is partial
    b = seq("b", list(range(10)))
    assert bm.match_prefix(b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    c = seq("c", list(range(9)))
    assert bm.match_prefix(c) == 8  # still cached after both owners finished
    bm.free(c)
    # Different content after the first block: only the first block matches.
    d = seq("d", [0, 1, 2, 3, 99, 99, 99, 99, 5])
    assert bm.match_prefix(d) == 4


def test_whole_prompt_cached_still_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(8)))
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.commit_full_blocks(a, a.num_computed_tokens)
    bm.free(a)
    b = seq("b", list(range(8)))
    assert bm.match_prefix(b) == 4


def test_eviction_reuses_least_recently_freed_block():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq("a", [1, 2, 3])
    bm.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    bm.commit_full_blocks(a, a.num_computed_tokens)
    bm.free(a)
    other = seq("x", [7, 7, 7, 7])
    assert bm.allocate_slots(other, 4)  # needs both blocks: the cached one is evicted
    assert not bm.hash_to_block
    bm.free(other)
    assert bm.match_prefix(seq("a2", [1, 2, 3])) == 0


def test_scheduler_chunks_prefill_under_token_budget_and_preempts_newest():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), bm)
    a, b = seq("a", list(range(10))), seq("b", list(range(20, 25)))
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in step] == [("a", 6)]
    a.num_computed_tokens += 6
    step = sched.schedule()
    # a finishes its prompt (4 tokens), b gets the remaining budget (2 tokens)
    assert [(s.seq.request_id, s.num_tokens) for s in step] == [("a", 4), ("b", 2)]
    assert step[0].samples and not step[1].samples
    a.num_computed_tokens += 4
    b.num_computed_tokens += 2
    a.token_ids += [1, 2, 3]  # a grows to 13 tokens: needs a 4th block; b holds 1 block -> out of blocks
    a.num_computed_tokens = 12
    b.num_computed_tokens = 5
    b.token_ids.append(9)
    step = sched.schedule()
    assert sched.num_preemptions == 1
    assert [s.seq.request_id for s in step] == ["a"]
    assert sched.waiting[0] is b and b.num_computed_tokens == 0 and not b.block_table


def test_finish_frees_blocks_immediately():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), bm)
    a = seq("a", list(range(6)))
    sched.add(a)
    sched.schedule()
    assert bm.num_free_blocks == 2
    sched.finish(a, "abort")
    assert bm.num_free_blocks == 4 and not sched.has_work()


def test_requests_admitted_in_one_step_share_the_blocks_being_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    a, b = seq("a", list(range(10))), seq("b", list(range(8)) + [50, 51])
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    # b reuses a's two full blocks in the very step that computes them; only its tail is computed.
    assert [(s.seq.request_id, s.num_tokens) for s in step] == [("a", 10), ("b", 2)]
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2


def test_reset_prefix_cache_forgets_only_free_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a", list(range(9))), seq("b", [9] * 9)
    for s in (a, b):
        bm.allocate_slots(s, 9)
        bm.commit_full_blocks(s, 9)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2  # a's two full blocks; b's stay registered while in use
    assert bm.match_prefix(seq("a2", list(range(9)))) == 0
    assert bm.match_prefix(seq("b2", [9] * 9)) == 8


def test_cache_salts_never_share_blocks_and_equal_salts_do():
    """Prefix caching per tenant: a prompt cached under one salt is a miss under another (or none),
    and a hit under the same salt; the salt of the first block carries through the chain."""
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(13))

    def salted(rid: str, salt: str | None) -> Sequence:
        return Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=4, cache_salt=salt))

    def run(s: Sequence) -> int:
        return _prefill(bm, s)

    a = salted("a", "tenant-a")
    assert run(a) == 0
    others = [salted("b", "tenant-b"), salted("none", None), salted("prefix", "tenant-")]
    for other in others:
        assert run(other) == 0
        assert not set(other.block_table) & set(a.block_table)
    again = salted("a2", "tenant-a")
    assert run(again) == 12
    assert again.block_table[:3] == a.block_table[:3]
    for s in [a, again, *others]:
        bm.free(s)
    # Freed blocks stay cached per salt.
    assert run(salted("b2", "tenant-b")) == 12 and run(salted("none2", None)) == 12


def test_prefixes_whose_python_hashes_collide_are_cached_apart():
    """hash() of an int is the int modulo 2**61 - 1, so two prompts differing by that in one token had equal
    chain keys: the second's blocks never entered the cache (the key was taken), and a key alone could not
    tell the prefixes apart. The keyed digests are distinct: each prompt's repeat reuses its own blocks."""
    m = 2**61 - 1
    a_ids, b_ids = [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4 + m, 5, 6, 7, 8, 9]
    assert hash((None, 0, tuple(a_ids[:4]))) == hash((None, 0, tuple(b_ids[:4])))  # the old keys collide
    bm = BlockManager(num_blocks=32, block_size=4)

    def run(s: Sequence) -> int:
        return _prefill(bm, s)

    a, b = seq("a", a_ids), seq("b", b_ids)
    assert run(a) == 0 and run(b) == 0
    a_blocks, b_blocks = a.block_table[:2], b.block_table[:2]
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.free(b)
    a2, b2 = seq("a2", a_ids), seq("b2", b_ids)
    assert run(a2) == 8 and a2.block_table[:2] == a_blocks
    assert run(b2) == 8 and b2.block_table[:2] == b_blocks


def _prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit `s` (its prefix-cache hit, then slots for the rest), compute it all and commit its full blocks;
    the number of tokens the cache gave."""
    reused = bm.match_prefix(s)
    assert bm.allocate_slots(s, s.num_tokens - reused)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s, s.num_tokens)
    return reused
