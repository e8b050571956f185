"""Presence / frequency / repetition penalties, with the penalty state kept on the driver and fed one token per
step (session 40): greedy output equals transformers' generate with the penalties applied in plain torch; a
seeded penalised request's output is the same alone, in batches whose order changes, preempted on a tiny
KV cache (its state dropped and rebuilt from its whole history), and with every step resending whole histories
as the engine did before; and the state is gone once the requests are.

Every property here is the engine's penalty bookkeeping, not what the model says, so the file runs on
`tiny_llama` (RANDOM weights, the default model's vocabulary) with transformers on the same checkpoint
(`tiny_hf_model`) as the reference; its outputs mean nothing, they only have to agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rayllm.engine.engine import LLMEngine
from rayllm.schema.sampling_params import SamplingParams
from tests.engine.test_engine import make_engine

pytestmark = pytest.mark.slow  # a model runs (on the default model's tokenizer) and Ray starts: `make test-fast` skips it

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.15)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=2024, max_tokens=16, ignore_eos=True, **PENALTIES)


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the output tokens so far, in plain torch."""

    def __init__(self, num_prompt: int, presence: float, frequency: float) -> None:
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.stack([torch.bincount(row[self.num_prompt:], minlength=scores.shape[1])[: scores.shape[1]]
                              for row in input_ids]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def engine(tiny_llama, eos) -> LLMEngine:
    eng = make_engine(tiny_llama, eos)
    yield eng
    eng.shutdown()


def driver_sampling(engine: LLMEngine):
    return engine.executor.worker.runner.sampling


def resending(engine: LLMEngine) -> None:
    """The engine before session 40: every step sends each penalised sequence's whole history."""
    build = engine._seq_step

    def seq_step(sc):
        step = build(sc)
        if step.history is not None:
            step.history, step.history_start = sc.seq.token_ids, 0
        return step

    engine._seq_step = seq_step  # type: ignore[method-assign]


def state_after_next_step(engine: LLMEngine, prompt: list[int]):
    """The driver's penalty state once the engine has run one more step (which carries the requests
    finished since the last one to the driver)."""
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return driver_sampling(engine).penalty


def seeded(i: int) -> SamplingParams:
    return dataclasses.replace(SEEDED, seed=SEEDED.seed + i, presence_penalty=0.5 + 0.1 * (i % 3))


def test_penalised_greedy_equals_transformers_with_plain_torch_penalties(engine, tiny_hf_model, eos, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=48, **PENALTIES)
    got = engine.generate(chat_prompts[:3], params)
    for ids, out in zip(chat_prompts[:3], got, strict=True):
        with torch.no_grad():
            gen = tiny_hf_model.generate(
                torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                repetition_penalty=PENALTIES["repetition_penalty"],  # transformers' own, over prompt + output
                logits_processor=LogitsProcessorList([PresenceFrequency(len(ids), PENALTIES["presence_penalty"],
                                                                        PENALTIES["frequency_penalty"])]))
        assert out == gen[0, len(ids):].tolist()
    unpenalised = engine.generate(chat_prompts[:3], SamplingParams(temperature=0.0, max_tokens=48))
    assert unpenalised != got  # the penalties did change the output
    assert not state_after_next_step(engine, chat_prompts[0]).slots


def test_seeded_penalised_output_alone_in_changing_batches_preempted_and_resent(engine, tiny_llama, eos, chat_prompts):
    alone = engine.generate(chat_prompts[:1], SEEDED)[0]
    assert len(alone) == SEEDED.max_tokens
    # Beside others (penalised with other seeds, and plain), first and last in the batch; the others finish at
    # other lengths, so the batch's order and size change under it.
    others = [dataclasses.replace(seeded(i), max_tokens=2 + 3 * i) for i in range(1, 5)]
    plain = SamplingParams(temperature=1.0, max_tokens=12)
    assert engine.generate(chat_prompts[:5] + chat_prompts[5:7], [SEEDED, *others, plain, plain])[0] == alone
    assert engine.generate(chat_prompts[5:7] + chat_prompts[1:5] + chat_prompts[:1],
                           [plain, plain, *others, SEEDED])[-1] == alone
    batch = [seeded(i) for i in range(len(chat_prompts))]
    batch[0] = SEEDED
    together = engine.generate(chat_prompts, batch)
    assert together[0] == alone
    resending(engine)
    try:
        assert engine.generate(chat_prompts, batch) == together
    finally:
        del engine._seq_step  # the class's own again
    state = state_after_next_step(engine, chat_prompts[0])
    assert not state.slots and state.seen is None  # the memory is given back

    tiny = make_engine(tiny_llama, eos, num_blocks_override=20)  # 8 x 4 blocks of 16 tokens, 1 shared: 25 > 20
    try:
        sampling = driver_sampling(tiny)
        dropped: list[str] = []
        drop = sampling.preempted
        sampling.preempted = lambda ids: dropped.extend(ids) or drop(ids)  # type: ignore[method-assign]
        assert tiny.generate(chat_prompts, batch) == together
        assert tiny.scheduler.num_preemptions > 0 and dropped  # states dropped, then rebuilt from whole histories
        assert state_after_next_step(tiny, chat_prompts[0]).seen is None
    finally:
        tiny.shutdown()


def test_an_abort_drops_the_penalty_state(engine, chat_prompts):
    for i, ids in enumerate(chat_prompts[:3]):
        engine.add_request(f"pen-abort-{i}", ids, seeded(i))
    for _ in range(6):
        engine.step()
    state = driver_sampling(engine).penalty
    assert set(state.slots) == {f"pen-abort-{i}" for i in range(3)}
    for i in range(3):  # the driver holds every token but the one sampled last, which the next step brings
        seq = engine.seqs[f"pen-abort-{i}"]
        assert state.lengths[seq.request_id] == seq.penalty_synced == seq.num_tokens - 1 > seq.num_prompt_tokens
        engine.abort(seq.request_id)
    assert not state_after_next_step(engine, chat_prompts[0]).slots


def test_tensor_parallel_2_penalised_output_equals_one_rank(engine, tiny_llama, eos, chat_prompts, ray_local):
    """Every rank gets the same step messages (new tokens, finished and preempted ids); rank 0 alone keeps
    the penalty state and samples: two ranks give one rank's output, the tiny cache's preemptions included."""
    import ray

    # Greedy: the ranks' partial sums add up in another order than one rank's, and a seeded draw would
    # magnify that; greedy output is what the other tensor-parallel tests compare too.
    batch = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **PENALTIES)] * 4
    want = engine.generate(chat_prompts[:4], batch)
    # 4 x 3 prompt blocks of 16 tokens (the system prompt's first one shared: 9) fit; the 4th each needs from
    # their 12th token or so does not (13 > 10): preemptions after the penalty state was built.
    eng = make_engine(tiny_llama, eos, tp=2, num_blocks_override=10)
    try:
        assert eng.generate(chat_prompts[:4], batch) == want and eng.scheduler.num_preemptions > 0
        held = ray.get([w.__ray_call__.remote(lambda self: len(self.runner.sampling.penalty.slots))
                        for w in eng.executor.workers])
        assert held[1] == 0  # the other rank never held any
    finally:
        eng.shutdown()
