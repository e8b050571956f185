"""Fault isolation: a fault that belongs to one sequence fails that request alone (SequenceError), the
others in its batch finish with exactly their solo output, and the engine keeps serving. Faults are
injected into one sequence's own objects only (its parameters, its grammar matcher, its random generator,
its adapter id), never into the model; and a device out-of-memory inside a step (the test-only
debug.fail_step_with_oom_after) fails that step's requests, not the engine.

The engines run `tiny_llama` (RANDOM weights, the default model's vocabulary and end ids): isolation is the
engine's, and the reference is the same engine's solo output, whatever the model says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

from rayllm.engine.client.engine_client import EngineClient, InprocClient, ProcessClient
from rayllm.engine.client.engine_process import EngineProcess
from rayllm.engine.engine import LLMEngine, SequenceError
from rayllm.sample.guided import GrammarCompiler
from rayllm.schema.config import (
    CacheConfig,
    DebugConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import GuidedSpec, SamplingParams

pytestmark = pytest.mark.slow  # engines: `make test-fast` skips it

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12)
OVERFLOW_SEED = 2**64 + 5  # issue 17: "Overflow when unpacking long long" inside the step


@dataclass(frozen=True)
class UncheckedParams(SamplingParams):
    """SamplingParams that skip validation, as a path that bypassed it would: the seed reaches torch."""

    def __post_init__(self) -> None:
        pass


class ExplodingMatcher:
    """A grammar matcher whose bitmask fill fails (a bug or a corrupt grammar in one request)."""

    def fill_next_token_bitmask(self, bitmask, index) -> None:
        raise RuntimeError("matcher state corrupted")

    def is_terminated(self) -> bool:
        return False


class UnmaskedMatcher:
    """A real grammar matcher whose allowed-token mask allows every token (a mask the sampler gets wrong): the
    sampler draws what the grammar rejects."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill_next_token_bitmask(self, bitmask, index) -> None:
        bitmask[index].fill_(-1)  # every bit set

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class UndrawableGenerator:
    """A request's random stream that the batched draw cannot use (the draw raises TypeError)."""

    def get_state(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.uint8)

    def set_state(self, state: torch.Tensor) -> None:
        pass


def config(path: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=path, dtype="float32", max_model_len=1024),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        parallel=ParallelConfig(device="cpu"),
    )


@pytest.fixture(scope="module")
def engine(tiny_llama, eos):
    eng = LLMEngine(config(tiny_llama), eos_token_ids=eos)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def solo(engine, chat_prompts) -> dict[str, list[int]]:
    """Each good request's output when it runs alone."""
    out = {f"greedy{i}": engine.generate([chat_prompts[i]], GREEDY)[0] for i in range(3)}
    out["seeded"] = engine.generate([chat_prompts[3]], SEEDED)[0]
    assert all(out.values())  # each has tokens that a fault beside it could change
    return out


def good_requests(chat_prompts) -> dict[str, tuple[list[int], SamplingParams]]:
    reqs = {f"greedy{i}": (chat_prompts[i], GREEDY) for i in range(3)}
    reqs["seeded"] = (chat_prompts[3], SEEDED)
    return reqs


def run_to_end(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error is not None:
                assert out.finished and out.finish_reason == "abort"
                errors[out.request_id] = out.error
    return tokens, errors


def test_each_kind_of_sequence_fault_fails_only_its_request(engine, chat_prompts, solo):
    for rid, (prompt, params) in good_requests(chat_prompts).items():
        engine.add_request(rid, prompt, params)
    # Its sampling inputs: a seed torch cannot hold (built per row in the model runner).
    engine.add_request("bad-seed", chat_prompts[4], UncheckedParams(temperature=0.8, seed=OVERFLOW_SEED))
    # Its grammar matcher (used by the engine when it prepares the sequence's step).
    engine.add_request("bad-matcher", chat_prompts[5], GREEDY)
    engine.seqs["bad-matcher"].matcher = ExplodingMatcher()
    # Its random stream: the batched draw raises, and the sampler finds the culprit row by row.
    engine.add_request("bad-generator", chat_prompts[6], SEEDED)
    engine.executor.worker.runner.sampling.generators["bad-generator"] = UndrawableGenerator()
    # Its adapter: not loaded (this engine has no LoRA at all).
    engine.add_request("bad-adapter", chat_prompts[7], GREEDY, lora_slot=3)

    tokens, errors = run_to_end(engine)

    assert set(errors) == {"bad-seed", "bad-matcher", "bad-generator", "bad-adapter"}
    assert "Overflow" in errors["bad-seed"]
    assert "matcher state corrupted" in errors["bad-matcher"]
    assert "generator" in errors["bad-generator"]
    assert "adapter" in errors["bad-adapter"]
    for rid, expected in solo.items():
        assert tokens[rid] == expected, rid
    assert not engine.seqs and engine.block_manager.usage == 0.0
    # The engine goes on serving.
    assert engine.generate([chat_prompts[0]], GREEDY)[0] == solo["greedy0"]


def test_a_token_its_grammar_rejects_fails_only_its_request(engine, gguf_path, chat_prompts, solo):
    from rayllm.serve.chat_template import load_tokenizer

    tok = load_tokenizer(gguf_path)  # the default model's: tiny_llama's vocabulary
    digits = GrammarCompiler(tok, len(tok), [tok.eos_token_id]).compile(GuidedSpec("regex", "[0-9]+", "regex"))
    # Unconstrained, greedy decoding of this prompt starts with a token that is no digit: the grammar rejects it.
    first = engine.generate([chat_prompts[4]], dataclasses.replace(GREEDY, max_tokens=1))[0][0]
    assert not tok.decode([first]).strip()[:1].isdigit()
    for rid, (prompt, params) in good_requests(chat_prompts).items():
        engine.add_request(rid, prompt, params)
    engine.add_request("bad-mask", chat_prompts[4], GREEDY, grammar=digits)
    engine.seqs["bad-mask"].matcher = UnmaskedMatcher(engine.seqs["bad-mask"].matcher)

    tokens, errors = run_to_end(engine)

    assert list(errors) == ["bad-mask"] and "GrammarViolation" in errors["bad-mask"], errors
    assert tokens["bad-mask"] == []  # the rejected token is not sent
    for rid, expected in solo.items():
        assert tokens[rid] == expected, rid
    assert not engine.seqs and engine.block_manager.usage == 0.0


async def collect(engine: EngineClient, rid: str, prompt: list[int], params: SamplingParams):
    tokens: list[int] = []
    try:
        async for out in engine.generate(rid, prompt, params):
            tokens += out.new_token_ids
    except SequenceError as exc:
        assert exc.request_id == rid
        return exc
    return tokens


async def batch_with_a_faulty_request(engine: EngineClient, chat_prompts) -> dict[str, object]:
    reqs = good_requests(chat_prompts) | {"bad": (chat_prompts[4], UncheckedParams(temperature=0.8,
                                                                                    seed=OVERFLOW_SEED))}
    results = await asyncio.gather(*[collect(engine, rid, p, params) for rid, (p, params) in reqs.items()])
    return dict(zip(reqs, results, strict=True))


def check_isolated(results: dict[str, object], solo: dict[str, list[int]]) -> None:
    assert isinstance(results["bad"], SequenceError) and "Overflow" in str(results["bad"])
    for rid, expected in solo.items():
        assert results[rid] == expected, rid


def test_in_thread_async_engine_fails_only_the_faulty_request(engine, chat_prompts, solo):
    async_engine = InprocClient(engine)

    async def run():
        first = await batch_with_a_faulty_request(async_engine, chat_prompts)
        again = await collect(async_engine, "after", chat_prompts[0], GREEDY)
        return first, again

    try:
        first, again = asyncio.run(run())
    finally:
        async_engine.stop()  # the module's engine is shut down by its fixture
    check_isolated(first, solo)
    assert again == solo["greedy0"] and async_engine.error is None


def test_engine_process_fails_only_the_faulty_request(tiny_llama, eos, chat_prompts, solo, monkeypatch):
    # The child unpickles UncheckedParams by module name: let it import this test module.
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    assert UncheckedParams.__module__ == os.path.splitext(os.path.basename(__file__))[0]
    engine = ProcessClient(EngineProcess(config(tiny_llama), eos_token_ids=eos))

    async def run():
        first = await batch_with_a_faulty_request(engine, chat_prompts)
        again = await collect(engine, "after", chat_prompts[0], GREEDY)
        return first, again

    try:
        first, again = asyncio.run(run())
        check_isolated(first, solo)
        assert again == solo["greedy0"] and engine.error is None
        engine.check_health()
    finally:
        engine.shutdown()


def test_out_of_memory_in_a_step_fails_its_requests_and_the_engine_serves_on(tiny_llama, eos, chat_prompts, solo):
    """debug.fail_step_with_oom_after: the worker raises torch.OutOfMemoryError in the first step (as CUDA
    would): that step's requests fail with an error naming it, and the engine serves the next ones exactly.
    The step's prompt blocks were hashed when scheduled but never computed: a later request with the same
    prompt must not reuse them (its output equals its solo output, with nothing cached)."""
    base = config(tiny_llama)
    oom = LLMEngine(dataclasses.replace(base, debug=DebugConfig(fail_step_with_oom_after=0)), eos_token_ids=eos)
    try:
        for rid, (prompt, params) in good_requests(chat_prompts).items():
            oom.add_request(rid, prompt, params)
        tokens, errors = run_to_end(oom)
        assert set(errors) == set(good_requests(chat_prompts)) and not any(tokens.values())
        assert all(e.startswith("OutOfMemoryError:") and "injected" in e for e in errors.values())
        assert not oom.seqs and oom.block_manager.usage == 0.0
        oom.add_request("again", chat_prompts[0], GREEDY)
        again, errors = run_to_end(oom)
        assert not errors and again["again"] == solo["greedy0"]
        assert oom.executor.worker.steps > 1
    finally:
        oom.shutdown()
