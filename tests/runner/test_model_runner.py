"""Prompt logprobs come in row slices: each LM-head call of a step takes at most a slice's rows (the runner's
own record), and the numbers are transformers' fp32 log_softmax, and those of the unsliced computation (bit
for bit where the LM head is batch-invariant: scheduler.batch_invariant).

The model is `tiny_llama` (RANDOM weights, the default model's 49k vocabulary, so its LM head and the slices'
sizes are the real model's) against transformers on the same checkpoint: slicing is the runner's, whatever
the weights say."""

from __future__ import annotations

import itertools

import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.sample import logprobs
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.outputs import TokenLogprob
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # engines and transformers: `make test-fast` skips it

CHUNK, SLICE, K = 64, 8, 3  # tokens per step (a long prompt takes several), rows per slice, top-k asked
TEXT = "The history of Paris begins with a small settlement of the Parisii on an island in the Seine. " * 7
_ids = itertools.count()


def make_engine(path: str, eos: list[int], dtype: str, invariant: bool, cpu: CpuConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype=dtype),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=CHUNK, batch_invariant=invariant),
        parallel=ParallelConfig(device="cpu", cpu=cpu or CpuConfig()),
    ), eos_token_ids=eos)


def run(engine: LLMEngine, prompt: list[int], rows: int, neighbour: list[int] | None = None,
        monkeypatch=None) -> tuple[list[TokenLogprob | None], int, list[int]]:
    """The prompt's logprobs with slices of `rows` rows, the most rows one LM-head call took meanwhile, and
    what a greedy neighbour in the same steps generated."""
    monkeypatch.setattr(logprobs, "PROMPT_LOGPROB_SLICE_BYTES", rows * 4 * engine.arch.vocab_size)
    runner = engine.executor.worker.runner
    runner.largest_logits_rows = 0
    rid, other = f"p{next(_ids)}", f"n{next(_ids)}"
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K))
    if neighbour is not None:
        engine.add_request(other, neighbour, SamplingParams(temperature=0.0, max_tokens=8))
    got: list[TokenLogprob | None] = []
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            if out.request_id == rid and out.prompt_logprobs is not None:
                got = out.prompt_logprobs
            if out.request_id == other:
                tokens += out.new_token_ids
    return got, runner.largest_logits_rows, tokens


@pytest.fixture(scope="module")
def prompt(hf_tokenizer) -> list[int]:
    ids = hf_tokenizer(TEXT).input_ids
    assert len(ids) > 2 * CHUNK  # several chunks, each many slices
    return ids


@pytest.fixture(scope="module")
def reference(tiny_hf_model, prompt) -> torch.Tensor:
    """transformers' fp32 log_softmax: row i predicts prompt token i + 1."""
    with torch.no_grad():
        return tiny_hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches_reference(got: list[TokenLogprob | None], prompt: list[int], reference: torch.Tensor,
                             atol: float) -> None:
    assert got[0] is None and len(got) == len(prompt)
    for i, lp in enumerate(got[1:]):
        assert lp is not None and lp.token_id == prompt[i + 1]
        assert lp.logprob == pytest.approx(reference[i, prompt[i + 1]].item(), abs=atol)
        assert [v for _, v in lp.top] == pytest.approx(reference[i].topk(K).values.tolist(), abs=atol)
        assert [v for _, v in lp.top] == pytest.approx([reference[i, t].item() for t, _ in lp.top], abs=atol)


def test_sliced_prompt_logprobs_match_transformers_beside_a_decode(tiny_llama, tiny_hf_model, eos, prompt, reference,
                                                                   chat_prompts, monkeypatch):
    """With steps in two halves (cpu.half_step_tokens) where the prompt's chunk and the neighbour split: the
    halves sample, then the prompt's slices run on the whole step's hidden states."""
    before = torch.get_num_threads()
    engine = make_engine(tiny_llama, eos, "float32", invariant=False,
                         cpu=CpuConfig(threads_per_rank=1, half_step_tokens=4))
    try:
        halves = engine.executor.worker.runner.halves
        sliced, largest, neighbour = run(engine, prompt, SLICE, chat_prompts[0], monkeypatch)
        assert halves is not None and halves.steps > 0
        assert largest <= SLICE  # no LM-head call of any step built more than a slice of logits
        assert_matches_reference(sliced, prompt, reference, atol=1e-4)
        with torch.no_grad():  # transformers' greedy generate of the neighbour alone
            gen = tiny_hf_model.generate(torch.tensor([chat_prompts[0]]), max_new_tokens=8, do_sample=False,
                                         eos_token_id=eos, pad_token_id=eos[0])
        assert neighbour == gen[0, len(chat_prompts[0]):].tolist()  # its rows shared the prompt's steps
        whole, largest, _ = run(engine, prompt, CHUNK, monkeypatch=monkeypatch)
        assert largest == CHUNK  # one slice: the whole chunk at once (as before slicing), which the record shows
        # The same per-row math; fp32 GEMMs of other row counts may round the logits' last bit otherwise.
        for a, b in zip(sliced[1:], whole[1:], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [a.logprob, *(v for _, v in a.top)] == pytest.approx([b.logprob, *(v for _, v in b.top)],
                                                                        abs=1e-5)
    finally:
        engine.shutdown()
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_slices_equal_the_unsliced_numbers_bit_for_bit(tiny_llama, eos, prompt, reference, dtype,
                                                                        monkeypatch):
    engine = make_engine(tiny_llama, eos, dtype, invariant=True)
    try:
        sliced, largest, _ = run(engine, prompt, SLICE, monkeypatch=monkeypatch)
        assert largest <= SLICE
        whole, largest, _ = run(engine, prompt, CHUNK, monkeypatch=monkeypatch)
        assert largest == CHUNK
        assert sliced == whole
        # bf16 logits of magnitude ~20 round by ~0.1: a few tenths on an alternative (test_shipped_config's BF16_TOL).
        assert_matches_reference(sliced, prompt, reference, atol=1e-4 if dtype == "float32" else 0.5)
    finally:
        engine.shutdown()
