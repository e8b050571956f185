"""SamplingParams holds only what the engine can: anything that constructs can be sampled (property-based)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayllm.sample.sampling_inputs import SamplingInputs, prompt_logprobs
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep

VOCAB = 64
EDGE_INTS = [-(2**63) - 1, -(2**63), -2, -1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63,
             2**64 - 1, 2**64, 2**80]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-320, 1e-30, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e6, 1e6 + 1, 3e38,
               1e300, -1e-30, -1.0, -1e300]

# Edge values, anything, and (most often) values near the valid ranges, so most draws construct.
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(), st.integers(0, VOCAB + 3), st.integers(0, 40))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(), st.floats(0, 1), st.floats(0.01, 2), st.integers(0, 2))
kwargs = st.fixed_dictionaries({}, optional={
    "temperature": floats, "top_p": floats, "top_k": ints, "min_p": floats,
    "max_tokens": ints, "min_tokens": ints, "seed": st.none() | ints,
    "stop_token_ids": st.lists(ints, max_size=4).map(tuple),
    "logprobs": st.none() | ints, "prompt_logprobs": st.none() | ints,
    "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats,
    "logit_bias": st.lists(st.tuples(ints, floats), max_size=4).map(tuple),
    "ignore_eos": st.booleans(),
})


def sample_once(p: SamplingParams, logits: torch.Tensor, rid: str = "r") -> None:
    """One decode step of a sequence with these params beside a plain one, as the engine would build it."""
    history = [3, 9, 9, 17, 3, 40]  # 4 prompt tokens, 2 output tokens
    mask = p.stop_token_ids + (() if p.ignore_eos else (0,)) if p.min_tokens > 2 else ()
    seqs = [
        SeqStep(rid, [40], 5, [0], True, params=p, num_prompt_tokens=4, mask_token_ids=mask,
                history=history if p.needs_penalties else None),
        SeqStep("plain", [7], 5, [0], True, params=SamplingParams(temperature=0.0), num_prompt_tokens=4),
    ]
    result = SamplingInputs(VOCAB).sample(seqs, logits)
    assert not result.errors
    assert set(result.sampled) == {rid, "plain"} and all(0 <= t < VOCAB for t in result.sampled.values())
    if p.logprobs is not None:
        lp = result.logprobs[rid]
        assert len(lp.top) == min(p.logprobs, VOCAB) and lp.token_id == result.sampled[rid]
    if p.prompt_logprobs is not None:
        lps = prompt_logprobs(logits, [5, 6], p.prompt_logprobs)
        assert [len(lp.top) for lp in lps] == [min(p.prompt_logprobs, VOCAB)] * 2


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kwargs)
def test_params_that_construct_can_be_turned_into_tensors_and_sampled(fields):
    try:
        p = SamplingParams(**fields)
    except ValueError:
        return  # refused at the edge, with a message
    assert p.top_k == -1 or 1 <= p.top_k <= 2**31 - 1
    assert p.seed is None or 0 <= p.seed < 2**64
    for value in (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty):
        assert math.isfinite(value)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    sample_once(p, logits)
    # Per-choice seeds are seed + i (rayllm/serve/llm_server.py): they wrap to 64 bits as well.
    if p.seed is not None:
        sample_once(replace(p, seed=p.seed + 3), logits, rid="choice3")


def test_issue_17_inputs_are_normalised_not_fatal():
    assert SamplingParams(top_k=2**63).top_k == -1  # larger than any vocabulary: off
    assert SamplingParams(top_k=0).top_k == -1
    top = SamplingParams(seed=2**64 - 1)
    assert replace(top, seed=top.seed + 1).seed == 0  # the n-th choice of the largest seed
    assert SamplingParams(seed=-1).seed == 2**64 - 1
    assert SamplingParams(temperature=1e-9).greedy


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5), ("top_p", 0.0), ("top_p", math.nan),
    ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", 2**40), ("min_tokens", -1),
    ("presence_penalty", math.inf), ("repetition_penalty", 0.0), ("logprobs", -1), ("seed", 1.5),
    ("stop_token_ids", (2**63,)), ("logit_bias", ((5, math.nan),)), ("logit_bias", ((-1, 1.0),)), ("top_k", True),
])
def test_values_the_engine_cannot_hold_are_refused_with_the_field_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sequence_error_crosses_a_process_boundary():
    """The engine process sends a request's own failure over its pipe (pickled)."""
    import pickle

    from rayllm.schema.outputs import SequenceError

    err = pickle.loads(pickle.dumps(SequenceError("req-1", "bad seed")))
    assert isinstance(err, SequenceError) and err.request_id == "req-1" and str(err) == "bad seed"
