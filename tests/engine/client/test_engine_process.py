"""The engine in its own process (engine_process.EngineProcess behind engine_client.ProcessClient): refusals,
aborts, stats and grammars cross the pipe (a grammar once, however many requests use it), and a dead child
fails its requests and health. That its outputs equal the in-process engine's is checked in
test_engine_client.py. None of it depends on what the model says: the engines run conftest's tiny_llama (RANDOM
weights, the default model's vocabulary and end ids, so chat_prompts and its tokenizer fit), the tokenizer is the
default model's (grammars, the replica side's snapshot of its GGUF tokenizer)."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from rayllm.engine.client import engine_process
from rayllm.engine.client.engine_client import ProcessClient
from rayllm.engine.client.engine_process import EngineProcess, child_env
from rayllm.platforms.cpu.kernels import ONEDNN_CACHE_CAPACITY
from rayllm.sample.guided import GrammarCompiler
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.outputs import EngineDeadError, RequestRefused
from rayllm.schema.sampling_params import GuidedSpec, SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def config(model: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype="float32", max_model_len=2048),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
        parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1)),
    )


@pytest.fixture(scope="module")
def process_engine(tiny_llama, eos):
    engine = ProcessClient(EngineProcess(config(tiny_llama), eos_token_ids=eos))
    yield engine
    engine.shutdown()


async def collect(engine: ProcessClient, rid: str, prompt: list[int], params: SamplingParams, grammar=None):
    tokens: list[int] = []
    last = None
    async for out in engine.generate(rid, prompt, params, grammar=grammar):
        tokens += out.new_token_ids
        last = out
    return tokens, last


def test_refusal_abort_and_stats_cross_the_pipe(process_engine, chat_prompts):
    async def run():
        with pytest.raises(RequestRefused, match="max_model_len") as refused:
            await collect(process_engine, "too-long", chat_prompts[0], SamplingParams(max_tokens=4000))
        assert refused.value.param == "max_tokens"  # the field to change crossed the pipe with it
        # A consumer that leaves early aborts its request in the child: its blocks come back.
        gen = process_engine.generate("left", chat_prompts[1], SamplingParams(temperature=0.0, max_tokens=200))
        await anext(gen)
        await gen.aclose()
        return await asyncio.to_thread(process_engine.stats)  # after the abort: one pipe, in order

    stats = asyncio.run(run())
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0


def test_the_child_bounds_onednn_caches_unless_the_operator_set_them(process_engine):
    """Unbounded, oneDNN's two per-shape caches grew the served engine by hundreds of MB (docs/benchmarks.md)."""
    with open(f"/proc/{process_engine.process._proc.pid}/environ", "rb") as f:
        env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    wanted = child_env(dict(os.environ))  # the runner's own settings, if any, win
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == wanted["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert env["LRU_CACHE_CAPACITY"] == wanted["LRU_CACHE_CAPACITY"]
    assert child_env({}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": ONEDNN_CACHE_CAPACITY,
                             "LRU_CACHE_CAPACITY": ONEDNN_CACHE_CAPACITY}
    assert child_env({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "16"}) == \
        {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "16"}
    assert child_env({"DNNL_PRIMITIVE_CACHE_CAPACITY": "8"}) == \
        {"DNNL_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": ONEDNN_CACHE_CAPACITY}


def test_grammar_constrained_request_in_the_child(process_engine, hf_tokenizer, chat_prompts):
    """xgrammar objects do not pickle; they cross as JSON and constrain the child's sampling."""
    compiler = GrammarCompiler(hf_tokenizer, process_engine.vocab_size, [hf_tokenizer.eos_token_id])
    grammar = compiler.compile(GuidedSpec(kind="regex", value=r"(yes|no), [0-9]{3}", param="regex"))
    tokens, last = asyncio.run(collect(process_engine, "g", chat_prompts[0],
                                       SamplingParams(temperature=0.8, seed=1, max_tokens=20), grammar))
    assert re.fullmatch(r"(yes|no), [0-9]{3}", hf_tokenizer.decode(tokens, skip_special_tokens=True))
    assert last.finish_reason == "stop"


def test_a_dead_engine_process_fails_open_requests_and_health(tiny_llama, eos, chat_prompts):
    engine = ProcessClient(EngineProcess(config(tiny_llama), eos_token_ids=eos))
    try:
        async def run():
            # ignore_eos: the request is still open when the child dies, whatever the random model says.
            gen = engine.generate("r", chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
            await anext(gen)
            engine.process._proc.kill()  # a crash of the child (OOM kill, segfault)
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass

        asyncio.run(run())
        with pytest.raises(EngineDeadError):
            engine.check_health()
        assert engine.error is not None
    finally:
        engine.shutdown()


def test_eos_ids_from_a_function_that_runs_while_the_child_loads(tiny_llama, eos):
    """The model replica passes its tokenizer load as a function: it runs while the child imports torch and
    loads the model, and its ids join the model's own EOS before the engine reports ready (as a list would)."""
    import psutil

    before = {p.pid for p in psutil.Process().children()}
    with pytest.raises(RuntimeError, match="no tokenizer"):  # a failed load leaves no engine process behind
        EngineProcess(config(tiny_llama), eos_token_ids=lambda: (_ for _ in ()).throw(RuntimeError("no tokenizer")))
    assert {p.pid for p in psutil.Process().children()} <= before
    calls = []
    engine = ProcessClient(EngineProcess(config(tiny_llama), eos_token_ids=lambda: calls.append(1) or [7, *eos]))
    try:
        assert calls == [1]
        assert engine.process.call("eos_token_ids.copy") == frozenset([7, *eos, engine.arch.eos_token_id])
    finally:
        engine.shutdown()


# The model replica's side, in a fresh interpreter: its tokenizer (from the snapshot), the engine child, a
# streamed request, stats and a health check, as the replica makes them, and no torch import (which would hold
# the replica's GIL for seconds while Serve finishes its start-up, and cost its memory).
_REPLICA_SIDE = """
import asyncio, pickle, sys
from rayllm.engine.client.engine_client import make_engine_client
from rayllm.schema.sampling_params import SamplingParams
from rayllm.serve.detokenizer import IncrementalDetokenizer
from rayllm.serve.tokenizer import TokenizerService
import rayllm.serve.llm_server  # the replica's module

config, path = pickle.loads(bytes.fromhex(sys.argv[1]))
tok = TokenizerService(path)
engine = make_engine_client(config, lambda: tok.eos_token_ids, own_process=True)

async def run():
    prompt = tok.encode("The capital of France is")  # the replica never renders (the tokenizer replica does)
    detok = IncrementalDetokenizer(tok.tokenizer, prompt)
    text = ""
    async for out in engine.generate("r", prompt, SamplingParams(temperature=0.0, max_tokens=4)):
        text += detok.add(out.new_token_ids)[0]
    return text

text = asyncio.run(run())
stats = engine.stats()
engine.check_health()
engine.shutdown()
print(type(tok.tokenizer).__name__, stats.num_steps > 0, bool(text), "torch" in sys.modules, "transformers" in sys.modules)
"""


def test_the_replica_side_imports_no_torch(gguf_path, tiny_llama):
    import pickle
    import subprocess
    import sys

    from rayllm.serve.chat_template import load_serving_tokenizer

    # The snapshot in the tokenizer cache as any start leaves it (written through transformers when missing;
    # tests/serve/test_rust_tokenizer.py covers writing one), which the child then loads.
    load_serving_tokenizer(gguf_path)
    # The engine child runs tiny_llama, which shares the default model's vocabulary: the replica's tokenizer fits it.
    arg = pickle.dumps((config(tiny_llama), gguf_path)).hex()
    out = subprocess.run([sys.executable, "-c", _REPLICA_SIDE, arg], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["RustTokenizer", "True", "True", "False", "False"], out.stdout


# A guided request's grammar crosses the pipe once: its n choices, and later requests with the same compiled
# object (the server's grammar cache hands out one), name it by key. A 12 KB schema compiled to 132 MB of JSON,
# which took seconds per copy to serialize on the event loop and to read back in the engine loop.
_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "[A-Z][a-z]{1,12}"},
                                            "capital": {"type": "boolean"}},
           "required": ["city", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(process_engine, hf_tokenizer):
    return GrammarCompiler(hf_tokenizer, process_engine.vocab_size, [hf_tokenizer.eos_token_id])


def schema_spec(city_pattern: str = "[A-Z][a-z]{1,12}") -> GuidedSpec:
    """A distinct spec per pattern: a grammar object the child has not been sent yet."""
    schema = _SCHEMA | {"properties": _SCHEMA["properties"] | {"city": {"type": "string", "pattern": city_pattern}}}
    return GuidedSpec(kind="json_schema", value=json.dumps(schema), param="response_format")


def choice_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=60) for i in range(n)]  # as llm_server seeds choices


async def choices(engine: ProcessClient, name: str, prompt: list[int], grammar, n: int) -> list[list[int]]:
    runs = [collect(engine, f"{name}-{i}", prompt, p, grammar) for i, p in enumerate(choice_params(n))]
    return [tokens for tokens, _ in await asyncio.gather(*runs)]


def assert_valid(hf_tokenizer, outputs: list[list[int]], city_pattern: str = "[A-Z][a-z]{1,12}") -> None:
    import jsonschema

    for tokens in outputs:
        value = json.loads(hf_tokenizer.decode(tokens, skip_special_tokens=True))
        jsonschema.validate(value, json.loads(schema_spec(city_pattern).value))
        assert re.fullmatch(city_pattern, value["city"]), value


def test_n_choices_send_their_grammar_once(process_engine, compiler, hf_tokenizer, tiny_llama, eos, chat_prompts):
    from rayllm.engine.engine import LLMEngine

    process = process_engine.process
    grammar = compiler.compile(schema_spec())
    sent = process.grammars_sent
    outputs = asyncio.run(choices(process_engine, "n4", chat_prompts[0], grammar, 4))
    assert process.grammars_sent == sent + 1
    assert_valid(hf_tokenizer, outputs)
    # The same choices in this process's engine, on the grammar object itself: the child's copy constrains alike.
    engine = LLMEngine(config(tiny_llama), eos_token_ids=eos)
    try:
        for i, p in enumerate(choice_params(4)):
            engine.add_request(f"ref-{i}", chat_prompts[0], p, grammar=grammar)
        reference: dict[str, list[int]] = {f"ref-{i}": [] for i in range(4)}
        while engine.has_work():
            for out in engine.step():
                reference[out.request_id] += out.new_token_ids
    finally:
        engine.shutdown()
    assert outputs == list(reference.values())
    # A later request with the same compiled object (the compiler's cache returns it again) sends nothing new.
    again = asyncio.run(choices(process_engine, "again", chat_prompts[0], compiler.compile(schema_spec()), 4))
    assert process.grammars_sent == sent + 1 and again == outputs


def test_a_grammar_the_child_dropped_is_sent_again(process_engine, compiler, hf_tokenizer, chat_prompts, monkeypatch):
    """The parent decides what the child drops: with room for one grammar, the second request's grammar replaces
    the first while the first still runs (its sequences keep their matchers), and the first is sent again."""
    monkeypatch.setattr(engine_process, "GRAMMARS_HELD", 1)
    process = process_engine.process
    # Bounded patterns: the random model need not close a string, so an unbounded one could run to max_tokens.
    first, second = compiler.compile(schema_spec("[A-Z][a-z]{2,9}")), compiler.compile(schema_spec("[A-Z]{2,12}"))
    sent = process.grammars_sent

    async def run():
        return await asyncio.gather(choices(process_engine, "first", chat_prompts[1], first, 2),
                                    choices(process_engine, "second", chat_prompts[2], second, 2))

    a, b = asyncio.run(run())
    assert_valid(hf_tokenizer, a, "[A-Z][a-z]{2,9}")
    assert_valid(hf_tokenizer, b, "[A-Z]{2,12}")
    assert process.grammars_sent == sent + 2
    assert asyncio.run(choices(process_engine, "first-again", chat_prompts[1], first, 2)) == a
    assert process.grammars_sent == sent + 3


def test_a_grammar_over_the_bound_fails_only_its_request(process_engine, compiler, chat_prompts, monkeypatch):
    grammar = compiler.compile(GuidedSpec(kind="regex", value=r"[a-z]{1,5}!", param="regex"))
    monkeypatch.setattr(engine_process, "MAX_GRAMMAR_JSON_CHARS", len(grammar.serialize_json()) - 1)
    sent = process_engine.process.grammars_sent

    async def run():
        other = asyncio.create_task(collect(process_engine, "beside", chat_prompts[3],
                                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
        for rid in ("big", "big-again"):  # the same object is refused again
            with pytest.raises(RequestRefused, match="compiles to a grammar of .* over this server's limit") as refused:
                await collect(process_engine, rid, chat_prompts[0], SamplingParams(max_tokens=8), grammar)
            assert refused.value.param is None  # the model replica names the request's constraint field
        return await other

    tokens, last = asyncio.run(run())
    assert len(tokens) == 8 and last.finish_reason == "length"
    assert process_engine.process.grammars_sent == sent
    process_engine.check_health()


def test_a_request_cancelled_while_its_grammar_is_sent_is_aborted(process_engine, compiler, chat_prompts):
    """The add goes out from a thread regardless; the request's task ends only once its abort followed it."""
    grammar = compiler.compile(GuidedSpec(kind="regex", value=r"([a-z]+ ){100}", param="regex"))
    sent = process_engine.process.grammars_sent

    async def run():
        task = asyncio.create_task(collect(process_engine, "cancelled", chat_prompts[0],
                                           SamplingParams(temperature=0.0, max_tokens=400), grammar))
        await asyncio.sleep(0)  # the task now waits on the grammar's sender thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.to_thread(process_engine.stats)

    stats = asyncio.run(run())
    assert process_engine.process.grammars_sent == sent + 1  # the add did go out, and its abort after it
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0


def test_an_abort_the_dead_child_never_acknowledged_ends_with_none(tiny_llama, eos, chat_prompts):
    """A request left early waits for its abort's acknowledgement (generate's on_end, the replica's tracing); if
    the child dies first, on_end still comes, with None, so nothing waits on it for ever."""
    import signal

    engine = ProcessClient(EngineProcess(config(tiny_llama), eos_token_ids=eos))
    ends: list = []
    try:
        async def run():
            gen = engine.generate("r", chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True),
                                  on_end=ends.append)
            await anext(gen)
            os.kill(engine.process._proc.pid, signal.SIGSTOP)  # the abort below waits in the pipe, unread
            await gen.aclose()
            await asyncio.sleep(0.2)
            assert ends == [] and "r" in engine._ends
            engine.process._proc.kill()  # a crash of the child (OOM kill, segfault)
            for _ in range(200):
                if ends:
                    break
                await asyncio.sleep(0.05)

        asyncio.run(run())
        assert ends == [None] and engine._ends == {} and engine.error is not None
    finally:
        engine.shutdown()
