"""Prompt logprobs whatever the prefill's chunking: a last chunk of one token (the prompt one past the budget,
a one-token prompt, a chunk squeezed by running decodes) has nothing to predict yet completes the prompt, so
the logprobs still come out, equal to those of an unchunked prefill. On `tiny_llama` (tests/conftest.py:
RANDOM weights, the default model's vocabulary): the property is the engine's, whatever the weights."""

from __future__ import annotations

import itertools

import pytest

from rayllm.engine.engine import LLMEngine
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rayllm.schema.outputs import TokenLogprob
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # engines and transformers' tokenizer of the default model: `make test-fast` skips it

BUDGET = 64
TEXT = "The history of Paris begins with a small settlement of the Parisii on an island in the Seine. " * 8
_ids = itertools.count()


def make_engine(model_path: str, eos: list[int], budget: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model_path, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=16 << 20),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget),
        parallel=ParallelConfig(device="cpu"),
    ), eos_token_ids=eos)


@pytest.fixture(scope="module")
def chunked(tiny_llama, eos):
    eng = make_engine(tiny_llama, eos, BUDGET)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def unchunked(tiny_llama, eos):
    eng = make_engine(tiny_llama, eos, 512)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def text_ids(hf_tokenizer) -> list[int]:
    ids = hf_tokenizer(TEXT).input_ids
    assert len(ids) >= 2 * BUDGET + 1
    return ids


def prompt_logprobs(engine: LLMEngine, prompt: list[int], decodes: list[list[int]] = ()) -> list[TokenLogprob | None]:
    """The prompt's logprobs (top 2), its request added after `decodes` have started decoding beside it."""
    others = [f"d{next(_ids)}" for _ in decodes]
    for rid, ids in zip(others, decodes, strict=True):
        engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(3 if decodes else 0):  # their short prompts computed: they decode from now on
        engine.step()
    assert all(engine.seqs[rid].num_output_tokens for rid in others)
    rid = f"p{next(_ids)}"
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    sent: list[list[TokenLogprob | None]] = []
    chunks: list[int] = []
    while engine.has_work():
        seq = engine.seqs.get(rid)
        before = seq.num_computed_tokens if seq is not None else None
        for out in engine.step():
            assert out.error is None
            if out.request_id == rid:
                if out.prompt_logprobs is not None:
                    sent.append(out.prompt_logprobs)
                if before is not None and before < len(prompt):
                    chunks.append(engine.seqs[rid].num_computed_tokens - before if rid in engine.seqs
                                  else len(prompt) - before)
    assert len(sent) == 1, "sent once, when the prompt is computed"
    if decodes:
        assert chunks[-1] == 1, "the case under test: the last prompt chunk is one token"
    return sent[0]


def assert_equal(got: list[TokenLogprob | None], want: list[TokenLogprob | None], prompt: list[int]) -> None:
    assert len(got) == len(want) == len(prompt) and got[0] is None and want[0] is None
    for i, (a, b) in enumerate(zip(got[1:], want[1:], strict=True)):
        assert a.token_id == b.token_id == prompt[i + 1]
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        # fp32 GEMMs of other row counts may round the last bits: the same numbers otherwise.
        assert [a.logprob, *(v for _, v in a.top)] == pytest.approx([b.logprob, *(v for _, v in b.top)], abs=1e-4)


@pytest.mark.parametrize("length", [1, BUDGET, BUDGET + 1, BUDGET + 2, 2 * BUDGET + 1])
def test_prompt_logprobs_whatever_the_last_chunk_equal_an_unchunked_prefill(chunked, unchunked, text_ids, length):
    prompt = text_ids[:length]
    got = prompt_logprobs(chunked, prompt)
    assert_equal(got, prompt_logprobs(unchunked, prompt), prompt)
    if length == 1:
        assert got == [None]  # vLLM's shape: the first prompt token has no logprob


def test_prompt_squeezed_beside_decodes_keeps_its_logprobs(chunked, unchunked, text_ids):
    """Ten decodes take ten tokens of the budget: a prompt of budget - 9 tokens gets budget - 10 of them,
    then its last token alone."""
    prompt = text_ids[: BUDGET - 9]
    decodes = [text_ids[i : i + 5] for i in range(10)]
    assert_equal(prompt_logprobs(chunked, prompt, decodes), prompt_logprobs(unchunked, prompt), prompt)
