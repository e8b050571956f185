"""The driver's penalty state (sample/penalty_state.py), fed one new token per step as the engine sends it,
against two references on every step of a long run whose batch changes (order, sequences joining, finishing,
preempted and rebuilt): the sampler fed each sequence's whole history every step, as before session 40 (the
same tensors, bit for bit, and the same draws), and the penalties computed in plain torch per OpenAI / vLLM:
repetition over prompt + output, frequency and presence over the output."""

from __future__ import annotations

import dataclasses
import random

import torch

from rayllm.sample.sampler import processed_logits
from rayllm.sample.sampling_inputs import SamplingInputs, to_device
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep

VOCAB = 60


def reference_penalised(logits: torch.Tensor, tokens: list[int], num_prompt: int, p: SamplingParams) -> torch.Tensor:
    """One row's logits after the penalties, in plain torch."""
    x = logits.float().clone()
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[torch.tensor(tokens)] = True
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    counts = torch.bincount(torch.tensor(tokens[num_prompt:], dtype=torch.long), minlength=VOCAB).float()
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


PARAMS = [
    SamplingParams(temperature=0.9, seed=1, logprobs=5, presence_penalty=0.6, frequency_penalty=0.3,
                   repetition_penalty=1.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.8),
    SamplingParams(temperature=1.1, seed=7, frequency_penalty=-0.4),
    SamplingParams(temperature=0.7, seed=3, presence_penalty=1.5, logprobs=2),
    SamplingParams(temperature=0.8, seed=5),  # no penalties: the zero row beside the others
]


def check_state(incremental: SamplingInputs, full: list[SeqStep], logits: torch.Tensor, tokens: dict[str, list[int]],
                prompt: dict[str, int]) -> None:
    """The incremental state's rows against a fresh sampler given whole histories (the computation before
    session 40), bit for bit, and the penalised logits against plain torch."""
    cpu = torch.device("cpu")
    before = SamplingInputs(VOCAB)
    want = before.tensors([before.row(s, cpu) for s in full], cpu)
    penalised = [s.request_id if s.history is not None else None for s in full]
    assert (want.penalties is None) == (penalised == [None])  # r4, without penalties, alone
    if want.penalties is None:
        return
    seen, counts = incremental.penalty.rows(penalised, cpu, to_device)
    assert torch.equal(seen, want.penalties.seen) and torch.equal(counts, want.penalties.counts)
    processed = processed_logits(logits, dataclasses.replace(
        want, penalties=dataclasses.replace(want.penalties, seen=seen, counts=counts)))
    for j, s in enumerate(full):
        ref = reference_penalised(logits[j], tokens[s.request_id], prompt[s.request_id], s.params)
        assert torch.equal(processed[j], ref if penalised[j] else logits[j].float()), s.request_id


def test_incremental_state_equals_full_history_and_plain_torch_over_a_changing_batch():
    rnd = random.Random(0)
    incremental, resend = SamplingInputs(VOCAB), SamplingInputs(VOCAB)
    tokens = {f"r{i}": [rnd.randrange(VOCAB) for _ in range(rnd.randint(3, 40))] for i in range(len(PARAMS))}
    prompt = {rid: len(t) for rid, t in tokens.items()}
    params = {f"r{i}": p for i, p in enumerate(PARAMS)}
    synced = dict.fromkeys(tokens, 0)  # what the engine's Sequence.penalty_synced would say
    live = set(tokens)
    preemptions = rebuilds = 0
    for step in range(300):
        batch = rnd.sample(sorted(live), rnd.randint(1, len(live)))  # a new order every step
        preempted = [rid for rid in batch if synced[rid] and rnd.random() < 0.03]
        for rid in preempted:
            synced[rid] = 0
        incremental.preempted(preempted)
        preemptions += len(preempted)
        steps, full = [], []
        for rid in batch:
            t, p = tokens[rid], params[rid]
            penal = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
            rebuilds += bool(penal and synced[rid] == 0)
            steps.append(SeqStep(rid, [t[-1]], len(t) - 1, [0], True, params=p, num_prompt_tokens=prompt[rid],
                                 history=t[synced[rid]:] if penal else None, history_start=synced[rid]))
            full.append(SeqStep(rid, [t[-1]], len(t) - 1, [0], True, params=p, num_prompt_tokens=prompt[rid],
                                history=list(t) if penal else None))
            if penal:
                synced[rid] = len(t)
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        a, b = incremental.sample(steps, logits), resend.sample(full, logits)
        assert not a.errors and a.sampled == b.sampled and a.logprobs == b.logprobs, step
        check_state(incremental, full, logits, tokens, prompt)
        for rid in batch:
            tokens[rid].append(a.sampled[rid])
        if step % 60 == 59:  # one finishes, a new one takes its id's place: its state starts from nothing
            done = rnd.choice(sorted(live))
            incremental.forget([done])
            resend.forget([done])
            tokens[done] = [rnd.randrange(VOCAB) for _ in range(rnd.randint(3, 40))]
            prompt[done], synced[done] = len(tokens[done]), 0
    assert preemptions > 3 and rebuilds > 8
    assert max(len(t) - prompt[rid] for rid, t in tokens.items()) > 100  # long outputs: counts well above 1
    incremental.forget(sorted(live))
    assert incremental.penalty.seen is None and not incremental.penalty.slots  # the memory is given back


def test_a_step_that_does_not_continue_the_state_fails_that_sequence_alone():
    inputs = SamplingInputs(VOCAB)
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    first = [SeqStep(rid, [4], 3, [0], True, params=p, num_prompt_tokens=3, history=[1, 2, 3, 4]) for rid in "ab"]
    assert set(inputs.sample(first, logits).sampled) == {"a", "b"}
    # "a" skips a token (the engine's count and the driver's disagree); "b" goes on from where it was.
    later = [SeqStep("a", [9], 5, [0], True, params=p, num_prompt_tokens=3, history=[9], history_start=5),
             SeqStep("b", [9], 4, [0], True, params=p, num_prompt_tokens=3, history=[9], history_start=4)]
    out = inputs.sample(later, logits)
    assert "penalty state out of step" in out.errors["a"] and set(out.sampled) == {"b"}
    assert inputs.penalty.lengths["b"] == 5 and inputs.penalty.lengths["a"] == 4


def test_a_batch_redone_row_by_row_counts_each_new_token_once():
    """Building a step's tensors twice (the sampler's row-by-row redo after a failed batch) adds its tokens
    once: the counts equal the output's bincount."""
    inputs = SamplingInputs(VOCAB)
    p = SamplingParams(temperature=0.5, frequency_penalty=1.0)
    cpu = torch.device("cpu")
    rows = [inputs.row(SeqStep("a", [7], 5, [0], True, params=p, num_prompt_tokens=2, history=[1, 2, 7, 7, 3]), cpu)]
    first = inputs.tensors(rows, cpu).penalties
    again = inputs.tensors(rows, cpu).penalties
    assert first is not None and again is not None
    assert torch.equal(first.counts, again.counts)
    assert torch.equal(first.counts[0], torch.bincount(torch.tensor([7, 7, 3]), minlength=VOCAB).float())
