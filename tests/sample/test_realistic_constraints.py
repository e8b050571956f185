"""The realistic constraints rayllm.protocol.grammar_bounds lets through (tests/protocol/test_grammar_bounds.py)
compile with xgrammar and the real SmolLM2 tokenizer, and match an example output: the bounds refuse none of
what a client means by them."""

from __future__ import annotations

import json

import pytest

from rayllm.sample.guided import GrammarCompiler, new_matcher
from rayllm.schema.sampling_params import GuidedSpec
from tests.protocol.test_grammar_bounds import (
    GRAMMARS,
    JSON_GRAMMAR,
    MATH,
    PROFILE,
    REGEXES,
    UI,
    WEATHER_TOOL,
)

REGEX_OUTPUTS = ["jo.doe@example.com", "2026-11-29T17:12:26.5", "123e4567-e89b-12d3-a456-426614174000",
                 "555-555-555-1234", "1.2.3-rc.1", "a,bc,def", "abba", "192.168.0.1", "Ada Lovelace King", "foo bar baz", "1.22.333.4", "abc123",
                 "abcdefghijklmnopq", "a"]
GRAMMAR_OUTPUTS = {JSON_GRAMMAR: '{"a":[1,-2.5,"x",true,null]}', GRAMMARS[1]: "ab, cd, e", GRAMMARS[2]: "- a b\n- c\n",
                   GRAMMARS[3]: "no", GRAMMARS[4]: "555-1234",
                   GRAMMARS[5]: "ab,c,d"}
SCHEMA_OUTPUTS = [
    (MATH, {"steps": [{"explanation": "add", "output": "2"}], "final_answer": "2"}),
    (UI, {"type": "form", "label": "f", "children": [{"type": "button", "label": "ok", "children": [],
                                                      "attributes": []}], "attributes": [{"name": "a", "value": "b"}]}),
    (PROFILE, {"name": "Ada", "username": "@ada_1", "phone": "(555) 555-1234", "ip": "10.0.0.255",
               "scores": [99, 12.5], "tags": ["x"], "address": {"city": {"name": "Oslo", "zip": "01234-5678"}}}),
    (WEATHER_TOOL, {"location": "Bogotá, Colombia", "units": "celsius"}),
]


@pytest.fixture(scope="module")
def compiler(gguf_path):
    from rayllm.serve.chat_template import load_tokenizer

    tok = load_tokenizer(gguf_path)
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


def matches(compiler: GrammarCompiler, spec: GuidedSpec, text: str) -> bool:
    matcher = new_matcher(compiler.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(("pattern", "text"), zip(REGEXES, REGEX_OUTPUTS, strict=True))
def test_realistic_regexes_compile_and_match(compiler, pattern, text):
    assert matches(compiler, GuidedSpec("regex", pattern, "regex"), text)


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_realistic_grammars_compile_and_match(compiler, grammar):
    assert matches(compiler, GuidedSpec("ebnf", grammar, "ebnf"), GRAMMAR_OUTPUTS[grammar])


@pytest.mark.parametrize(("schema", "value"), SCHEMA_OUTPUTS)
def test_realistic_schemas_compile_and_match(compiler, schema, value):
    from jsonschema import validate

    validate(value, schema)  # the example is one the schema allows
    spec = GuidedSpec("json_schema", json.dumps(schema), "response_format")
    assert matches(compiler, spec, json.dumps(value, ensure_ascii=False))
