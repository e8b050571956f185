"""Why rayllm.protocol.schema_support refuses what it refuses: xgrammar (with the real SmolLM2 tokenizer) compiles
each refused schema into a grammar that accepts output jsonschema finds invalid. And the realistic schemas it lets
through compile, accept a valid example and refuse an invalid one (tests/protocol/test_schema_support.py)."""

from __future__ import annotations

import json

import pytest
from jsonschema import FormatChecker, validators

from rayllm.sample.guided import GrammarCompiler, new_matcher
from rayllm.schema.sampling_params import GuidedSpec
from tests.protocol.test_schema_support import ACCEPTED, REFUSED, Person

# An instance each refused schema forbids (None: jsonschema cannot resolve the remote $ref either).
BREAKS = [{"a": "s"}, {"a": 1}, {}, 3, {}, 3, 3, 1, {"x": 0.001}, 3, 7, None, "x", "x", {"a": 1}, [1, 1],
          "ab@cd.ef", "aaaa", "1999-01-01", {"p": 1}, [{"tags": ["a", "a"]}]]


@pytest.fixture(scope="module")
def compiler(gguf_path):
    from rayllm.serve.chat_template import load_tokenizer

    tok = load_tokenizer(gguf_path)
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


def grammar_accepts(compiler: GrammarCompiler, schema: object, value: object) -> bool:
    matcher = new_matcher(compiler.compile(GuidedSpec("json_schema", json.dumps(schema), "response_format")))
    return matcher.accept_string(json.dumps(value, ensure_ascii=False)) and matcher.is_completed()


def valid(schema: object, value: object) -> bool:
    return validators.validator_for(schema)(schema, format_checker=FormatChecker()).is_valid(value)


@pytest.mark.parametrize(("schema", "value"), [(r[0], v) for r, v in zip(REFUSED, BREAKS, strict=True)
                                                if v is not None])
def test_each_refused_schema_would_let_invalid_output_through(compiler, schema, value):
    assert not valid(schema, value)
    assert grammar_accepts(compiler, schema, value)


PET = {"kind": "cat", "lives": 3}
BOB = {"name": "Bob", "age": 30, "color": "green", "home": {"city": "Oslo", "zip": None}, "other": None,
       "tags": ["a"], "pet": PET, "pets": [{"kind": "dog", "good": False}, PET], "even": 4,
       "parent": {"name": "Al", "age": 60, "home": {"city": "Rome"}, "pet": {"kind": "dog"}}}
EXAMPLES = [(Person.model_json_schema(), BOB, BOB | {"pet": {"kind": "cat", "lives": 12}}),
            (Person.model_json_schema(), BOB, BOB | {"even": 3}),
            (Person.model_json_schema(), BOB, BOB | {"color": "blue"}),
            (ACCEPTED[5], None, 1.5), (ACCEPTED[6], "b", "c"), (ACCEPTED[7], 95, 96), (ACCEPTED[8], {"a": 1}, [1]),
            (ACCEPTED[9], {"not": "x", "if": "y"}, {"if": "y"}), (ACCEPTED[12], "abcde", "abcdef")]


@pytest.mark.parametrize(("schema", "good", "bad"), EXAMPLES)
def test_accepted_schemas_are_enforced(compiler, schema, good, bad):
    assert valid(schema, good) and not valid(schema, bad)
    assert grammar_accepts(compiler, schema, good) and not grammar_accepts(compiler, schema, bad)
