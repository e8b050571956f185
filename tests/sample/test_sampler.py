"""The sampler against references: transformers' logits processors and warpers, and a plain
implementation of the OpenAI penalties, on fixed random logits (one batch, each row its own params).

Checked: the set of tokens left after truncation and their probabilities, the distribution of many
seeded draws (total-variation distance, fixed seeds), and the reported logprob values after logit
bias, min_tokens masking, penalties and temperature.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rayllm.sample.sampler import processed_logits, sample, sampling_probs, scaled_logits
from rayllm.sample.sampling_inputs import SamplingInputs
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep

VOCAB = 40
EOS = 2
PROMPT = [5, 11, 11, 30]
OUTPUT = [7, 7, 7, 30, 12]  # generated so far: counts 3, 1, 1


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5


def build(params: list[SamplingParams], **extra) -> tuple[SamplingInputs, list]:
    inputs = SamplingInputs(VOCAB)
    steps = [SeqStep(f"r{i}", [1], 8, [0], True, params=p, num_prompt_tokens=len(PROMPT), **extra)
             for i, p in enumerate(params)]
    return inputs, [inputs.row(s, torch.device("cpu")) for s in steps]


# (our params, transformers' warpers in generate's order) per row of one batch.
TRUNCATION = [
    (SamplingParams(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    (SamplingParams(temperature=1.0, top_k=5), [TopKLogitsWarper(5)]),
    (SamplingParams(temperature=1.0, top_p=0.8), [TopPLogitsWarper(0.8)]),
    (SamplingParams(temperature=1.0, min_p=0.1), [MinPLogitsWarper(0.1)]),
    (SamplingParams(temperature=1.3, top_k=12, top_p=0.6),
     [TemperatureLogitsWarper(1.3), TopKLogitsWarper(12), TopPLogitsWarper(0.6)]),
    (SamplingParams(temperature=0.5, top_p=0.95), [TemperatureLogitsWarper(0.5), TopPLogitsWarper(0.95)]),
    (SamplingParams(temperature=1.0), []),
]


def reference_probs(logits: torch.Tensor, warpers: list) -> torch.Tensor:
    ids = torch.tensor([PROMPT])
    scores = logits.unsqueeze(0).clone()
    for w in warpers:
        scores = w(ids, scores)
    return scores.softmax(-1)[0]


def our_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    inputs, rows = build(params)
    t = inputs.tensors(rows, torch.device("cpu"))
    return sampling_probs(scaled_logits(processed_logits(logits, t), t), t)


def test_truncation_keeps_the_reference_tokens_with_the_reference_probabilities():
    logits = random_logits(len(TRUNCATION))
    ours = our_probs(logits, [p for p, _ in TRUNCATION])
    for i, (p, warpers) in enumerate(TRUNCATION):
        ref = reference_probs(logits[i], warpers)
        assert set(ours[i].nonzero().flatten().tolist()) == set(ref.nonzero().flatten().tolist()), p
        torch.testing.assert_close(ours[i], ref, atol=1e-6, rtol=1e-5)
    assert 1 <= int((ours[1] > 0).sum()) == 5  # the checks above are not vacuous: top_k kept 5 of 40


def total_variation(draws: list[int], probs: torch.Tensor) -> float:
    freq = torch.bincount(torch.tensor(draws), minlength=VOCAB).double() / len(draws)
    return 0.5 * float((freq - probs.double()).abs().sum())


def test_seeded_draws_follow_the_reference_distribution():
    """20,000 requests with seeds 0..19,999 on the same logits: the empirical distribution of their first
    tokens is within 0.03 total variation of transformers' (about 3x the expected sampling error)."""
    n = 20_000
    logits = random_logits(1, seed=3)[0]
    for params, warpers in (TRUNCATION[4], TRUNCATION[5], TRUNCATION[3]):
        ref = reference_probs(logits, warpers)
        inputs, rows = build([SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                             min_p=params.min_p, seed=s) for s in range(n)])
        draws, _ = sample(logits.expand(n, VOCAB), inputs.tensors(rows, torch.device("cpu")))
        assert set(draws) <= set(ref.nonzero().flatten().tolist())  # never a truncated token
        assert total_variation(draws, ref) < 0.03, params


def test_unseeded_draws_follow_the_reference_distribution():
    n = 20_000
    logits = random_logits(1, seed=4)[0]
    params, warpers = TRUNCATION[2]
    inputs, rows = build([params] * n)
    torch.manual_seed(0)
    draws, _ = sample(logits.expand(n, VOCAB), inputs.tensors(rows, torch.device("cpu")))
    assert total_variation(draws, reference_probs(logits, warpers)) < 0.03


def reference_logprobs(logits: torch.Tensor, p: SamplingParams, min_new_tokens: int) -> torch.Tensor:
    """logit_bias, min_tokens' EOS mask and repetition penalty by transformers' processors; presence and
    frequency penalties as OpenAI documents them; then temperature; log-softmax."""
    ids = torch.tensor([PROMPT + OUTPUT])
    scores = logits.unsqueeze(0).clone()
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[tok], bias] for tok, bias in p.logit_bias])(ids, scores)
    if min_new_tokens:
        scores = MinNewTokensLengthLogitsProcessor(len(PROMPT), min_new_tokens, EOS)(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB).float()
    scores = scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    if p.temperature > 0:
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    return scores.log_softmax(-1)[0]


def test_logprobs_after_bias_min_tokens_and_penalties_equal_the_reference():
    cases = [  # (params, whether EOS is masked by min_tokens)
        (SamplingParams(temperature=0.0, logprobs=VOCAB, logit_bias=((3, 4.0), (EOS, -1.5), (17, -100.0))), False),
        (SamplingParams(temperature=0.8, logprobs=VOCAB, repetition_penalty=1.3), False),
        (SamplingParams(temperature=1.0, logprobs=VOCAB, presence_penalty=0.7, frequency_penalty=0.4), False),
        (SamplingParams(temperature=0.6, logprobs=VOCAB, min_tokens=8, presence_penalty=-0.5,
                        repetition_penalty=0.8, logit_bias=((7, 2.0),)), True),
        (SamplingParams(temperature=0.0, logprobs=3, min_tokens=8), True),
    ]
    logits = random_logits(len(cases), seed=5)
    inputs = SamplingInputs(VOCAB)
    steps = [SeqStep(f"r{i}", [OUTPUT[-1]], 8, [0], True, params=p, num_prompt_tokens=len(PROMPT),
                     history=PROMPT + OUTPUT if p.needs_penalties else None, mask_token_ids=(EOS,) if masked else ())
             for i, (p, masked) in enumerate(cases)]
    result = inputs.sample(steps, logits)
    assert not result.errors
    for i, (p, masked) in enumerate(cases):
        ref = reference_logprobs(logits[i], p, min_new_tokens=8 if masked else 0)
        lp = result.logprobs[f"r{i}"]
        k = p.logprobs or 0
        top_ids = [tok for tok, _ in lp.top]
        assert top_ids == ref.topk(k).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), ref.topk(k).values)
        torch.testing.assert_close(torch.tensor(lp.logprob), ref[lp.token_id])
        if p.temperature == 0:
            assert lp.token_id == int(ref.argmax())
        if masked:
            assert lp.token_id != EOS and ref[EOS] == float("-inf")
            if k == VOCAB:
                assert dict(lp.top)[EOS] == float("-inf")
