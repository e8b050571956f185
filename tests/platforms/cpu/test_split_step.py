"""Where a step is cut into two halves (split_step.split_point), on steps the real scheduler builds."""

from __future__ import annotations

from rayllm.engine.block_manager import BlockManager
from rayllm.engine.scheduler import Scheduler
from rayllm.engine.sequence import Sequence
from rayllm.platforms.cpu.split_step import split_point
from rayllm.schema.config import SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep

BS = 4


def scheduled_step(prompts: list[list[int]], lora_slots: list[int] | None = None) -> list[SeqStep]:
    """One step of the real scheduler over these prompts, as the engine hands it to the runner."""
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256), bm)
    for i, p in enumerate(prompts):
        sched.add(Sequence(f"r{i}", list(p), len(p), SamplingParams(max_tokens=4),
                           lora_slots[i] if lora_slots else 0))
    steps = []
    for sc in sched.schedule():
        s, start = sc.seq, sc.seq.num_computed_tokens
        steps.append(SeqStep(s.request_id, s.token_ids[start : start + sc.num_tokens], start, s.block_table,
                             sc.samples, lora_slot=s.lora_slot))
    return steps


def decode(rid: str, pos: int, table: list[int]) -> SeqStep:
    return SeqStep(rid, [7], pos, table, True)


def test_a_decode_batch_is_cut_in_the_middle():
    steps = [decode(f"d{i}", 9, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(64)]
    assert split_point(steps, BS, 32) == 32
    assert split_point(steps[:31], BS, 32) == 0  # below the threshold: whole


def test_a_prefill_chunk_beside_decodes_balances_tokens():
    steps = [decode(f"d{i}", 9, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(40)]
    steps += scheduled_step([list(range(100, 130))])  # a 30-token prompt in fresh blocks
    steps[-1].block_table = [b + 500 for b in steps[-1].block_table]
    cut = split_point(steps, BS, 32)
    first = sum(len(s.token_ids) for s in steps[:cut])
    assert cut == 35 and first == 35  # 35 decodes | 5 decodes + the prompt's 30 tokens


def test_one_sequence_holding_most_of_the_step_runs_whole():
    steps = scheduled_step([list(range(100, 200))])
    steps.insert(0, decode("d", 9, [500, 501, 502]))
    assert split_point(steps, BS, 32) == 0


def test_a_batch_with_an_adapter_runs_whole():
    prompts = [list(range(100 + 20 * i, 120 + 20 * i)) for i in range(4)]
    assert split_point(scheduled_step(prompts), BS, 32) == 2
    assert split_point(scheduled_step(prompts, lora_slots=[0, 0, 1, 0]), BS, 32) == 0


def test_a_request_reading_blocks_another_fills_in_the_same_step_is_not_separated_from_it():
    shared = list(range(100, 112))
    other = list(range(200, 212))
    steps = scheduled_step([shared, shared, other])
    a, b, c = steps
    # The second request reuses the two full blocks the first one fills in this very step.
    assert b.start_pos == 8 and b.block_table[:2] == a.block_table[:2]
    assert [len(s.token_ids) for s in steps] == [12, 4, 12]
    assert split_point(steps, BS, 8) == 0  # the balanced cut (after a) would separate a from b
    assert split_point(scheduled_step([shared, other]), BS, 8) == 1  # unrelated prompts split


def test_the_lm_head_in_two_vocabulary_halves_is_bit_equal_to_one_call():
    """Random weights (an odd vocabulary, so the halves differ in size), bf16 and fp32, through oneDNN."""
    import torch

    from rayllm.platforms.cpu.onednn import OneDNNWeight
    from rayllm.platforms.cpu.split_step import HalfThread, VocabHalves

    before = torch.get_num_threads()
    thread = HalfThread()
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float32):
            weight = torch.randn(1001, 64, generator=g).to(dtype)
            whole, halves = OneDNNWeight(weight), VocabHalves(weight, thread)
            for rows in (1, 5, 16):
                x = torch.randn(rows, 64, generator=g).to(dtype)
                calls = thread.lm_head_calls
                assert torch.equal(halves(x, None), whole(x, None))
                assert thread.lm_head_calls == calls + 1  # on both threads
                thread.idle = False  # inside a step run in halves: both parts on the calling thread
                assert torch.equal(halves(x, None), whole(x, None))
                assert thread.lm_head_calls == calls + 1
                thread.idle = True
    finally:
        thread.close()
        torch.set_num_threads(before)
