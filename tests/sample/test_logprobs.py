"""Prompt logprobs in row slices: the same numbers as all rows at once, bit for bit, with every LM-head call
at most a slice's rows; a sequence's fault stays its own, and every rank runs the same LM-head calls."""

from __future__ import annotations

import pytest
import torch

from rayllm.sample import logprobs
from rayllm.sample.logprobs import PromptRows, balanced_slices, profile_one_slice, sliced_prompt_logprobs
from rayllm.sample.sampling_inputs import prompt_logprobs
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep

VOCAB, HIDDEN = 1000, 64


class Head(torch.nn.Module):
    """A real LM head (a linear layer) that keeps the row count of each call: what the step built. It runs
    one row at a time, so that a row's logits do not depend on how many rows a call has (as with
    scheduler.batch_invariant; a GEMM over more rows may round fp32 logits' last bit otherwise)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
        self.calls: list[int] = []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.linear(row) for row in hidden.split(1)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return self.logits(hidden)


def seq(rid: str, targets: list[int], k: int | None) -> SeqStep:
    return SeqStep(rid, [0] * len(targets), 0, [0], False, params=SamplingParams(prompt_logprobs=k),
                   prompt_logprob_targets=targets)


@pytest.fixture
def slice_of(monkeypatch):
    def set_rows(rows: int) -> None:
        monkeypatch.setattr(logprobs, "PROMPT_LOGPROB_SLICE_BYTES", rows * 4 * VOCAB)

    return set_rows


def test_balanced_slices_cover_every_row_once_at_most_the_bound_each():
    for total in range(1, 60):
        for most in range(1, 20):
            cuts = balanced_slices(total, most)
            assert [r for a, b in cuts for r in range(a, b)] == list(range(total))
            sizes = [b - a for a, b in cuts]
            assert max(sizes) <= most and len(cuts) == -(-total // most) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_give_the_numbers_of_all_rows_at_once(dtype, slice_of):
    torch.manual_seed(0)
    head = Head(dtype)
    gen = torch.Generator().manual_seed(1)
    # Three sequences' chunks in one step (a decode row between two of them), 37 + 5 + 20 prompt rows.
    lengths, ks = [37, 1, 5, 20], [3, None, 0, 7]
    hidden = torch.randn(sum(lengths) + 4, HIDDEN, generator=gen).to(dtype)
    seqs, first = [], 0
    for i, (n, k) in enumerate(zip(lengths, ks, strict=True)):
        if k is not None:
            targets = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            seqs.append(PromptRows(seq(f"r{i}", targets, k), first))
        first += n
    slice_of(8)
    with torch.inference_mode():
        got = sliced_prompt_logprobs(hidden, seqs, VOCAB, head, gather=True)
        assert got.errors == {} and max(head.calls) <= 8 and sum(head.calls) == 37 + 5 + 20
        for p in seqs:
            s = p.seq
            n = len(s.prompt_logprob_targets)
            whole = head.logits(hidden[p.first : p.first + n])
            # The unsliced computation (what the runner did before), bit for bit.
            assert got.logprobs[s.request_id] == prompt_logprobs(whole, s.prompt_logprob_targets,
                                                                 s.params.prompt_logprobs)
            # And the reference: fp32 log_softmax of the head's logits, its top-k in order.
            ref = whole.float().log_softmax(-1)
            for row, lp in enumerate(got.logprobs[s.request_id]):
                assert lp.logprob == ref[row, s.prompt_logprob_targets[row]].item()
                vals, ids = ref[row].topk(s.params.prompt_logprobs)
                assert lp.top == list(zip(ids.tolist(), vals.tolist(), strict=True))


def test_a_sequences_fault_is_its_own_and_every_rank_makes_the_same_calls(slice_of):
    torch.manual_seed(0)
    hidden = torch.randn(30, HIDDEN)
    # A target past the vocabulary in the slice that "bad" shares with "good" (rows 6-11), after a slice of its own.
    bad = PromptRows(seq("bad", [1, 2, 3, 4, 5, 6, 7, 8, VOCAB + 5, 9], 2), 0)
    good = PromptRows(seq("good", list(range(20)), 2), 10)
    failed_before = PromptRows(seq("sampled-and-failed", [1], 2), 29)
    slice_of(7)
    driver, other = Head(torch.float32), Head(torch.float32)
    with torch.inference_mode():
        got = sliced_prompt_logprobs(hidden, [bad, good, failed_before], VOCAB, driver, gather=True,
                                     skip={"sampled-and-failed"})
        assert set(got.errors) == {"bad"} and set(got.logprobs) == {"good"}
        assert got.logprobs["good"] == prompt_logprobs(driver.logits(hidden[10:30]), list(range(20)), 2)
        assert sliced_prompt_logprobs(hidden, [bad, good, failed_before], VOCAB, other, gather=False).logprobs == {}
    assert driver.calls == other.calls == [6, 6, 6, 6, 7]  # 31 rows in near-equal slices, on every rank


def test_profiling_runs_one_full_slice(slice_of):
    head = Head(torch.float32)
    slice_of(16)
    with torch.inference_mode():
        profile_one_slice(torch.zeros(100, HIDDEN), VOCAB, head)
        profile_one_slice(torch.zeros(5, HIDDEN), VOCAB, head)  # a step shorter than a slice
    assert head.calls == [16, 5]
