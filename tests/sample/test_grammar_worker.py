"""Grammar compilation in a child process with a time limit, and the byte-bounded cache
(rayllm.sample.grammar_worker, rayllm.sample.guided), with the real SmolLM2 tokenizer and xgrammar."""

from __future__ import annotations

import json

import pytest

from rayllm.sample.guided import GrammarCompiler, new_matcher, next_token_bitmask
from rayllm.schema.sampling_params import GuidedSpec

SCHEMA = GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"]}), "response_format")
# Thousands of `[a-z]*` in a row: small (21 KB) but takes xgrammar tens of seconds to compile.
SLOW = GuidedSpec("ebnf", "root ::= " + " ".join("[a-z]*" for _ in range(3000)), "ebnf")


@pytest.fixture(scope="module")
def tok(gguf_path):
    from rayllm.serve.chat_template import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def isolated(tok):
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], timeout_s=3.0)
    yield compiler
    compiler.close()


def test_child_compiles_the_same_grammar_as_in_process(tok, isolated):
    ref = GrammarCompiler(tok, len(tok), [tok.eos_token_id]).compile(SCHEMA)
    got = isolated.compile(SCHEMA)
    a, b = new_matcher(ref), new_matcher(got)
    for text in ('{"a": ', "12", "}"):  # xgrammar's compact form keeps the space after ':'
        assert a.accept_string(text) == b.accept_string(text) is True
        assert next_token_bitmask(a, len(tok)).equal(next_token_bitmask(b, len(tok)))
    assert a.accept_token(tok.eos_token_id) and b.accept_token(tok.eos_token_id)  # complete: may stop


def test_slow_compile_times_out_and_the_next_compile_works(isolated):
    with pytest.raises(ValueError, match="more than this server's limit of 3 s of CPU time"):
        isolated.compile(SLOW)
    assert isolated.compile(GuidedSpec("regex", "[0-9]{3}", "regex")) is not None


def test_invalid_grammar_is_a_value_error_from_the_child(isolated):
    with pytest.raises(ValueError):
        isolated.compile(GuidedSpec("ebnf", "root ::= undefined_rule", "ebnf"))


def test_cache_is_bounded_in_bytes(tok):
    one = GrammarCompiler(tok, len(tok), [tok.eos_token_id]).compile(SCHEMA).memory_size_bytes
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], cache_bytes=int(2.5 * one))
    specs = [GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}),
                        "guided_json") for i in range(6)]
    for spec in specs:
        compiler.compile(spec)
    assert 0 < compiler.cached_bytes <= int(2.5 * one)
    before = compiler.num_compiled
    compiler.compile(specs[-1])  # most recent: still cached
    assert compiler.num_compiled == before
    compiler.compile(specs[0])  # evicted: compiled again
    assert compiler.num_compiled == before + 1


@pytest.mark.parametrize("valid", [True, False], ids=["compiles", "invalid"])
def test_concurrent_requests_for_one_new_grammar_share_one_compile(tok, valid):
    """A burst of requests with the same new schema (the compile pool's threads all missing the cache at
    once) compiles it once in the child; each caller gets that grammar, or that compile's error."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    spec = SCHEMA if valid else GuidedSpec("ebnf", "root ::= undefined_rule", "ebnf")
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], timeout_s=10.0)
    barrier = Barrier(6)

    def call(_: int) -> object:
        barrier.wait()
        try:
            return compiler.compile(spec)
        except ValueError as exc:
            return exc

    try:
        with ThreadPoolExecutor(6) as pool:
            out = list(pool.map(call, range(6)))
    finally:
        compiler.close()
    if valid:
        assert compiler.num_compiled == 1 and all(o is out[0] for o in out)
        assert new_matcher(out[0]).accept_string('{"a": 1}')
    else:
        assert compiler.num_compiled == 0 and all(isinstance(o, ValueError) and str(o) == str(out[0]) for o in out)
