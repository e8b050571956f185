"""rayllm.protocol.limits' JSON nesting bound, and where a client's JSON meets it (structured outputs, tools):
deeper than MAX_JSON_DEPTH is a 400 naming the field, or stays the client's text, never a RecursionError."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rayllm.protocol.errors import APIError
from rayllm.protocol.limits import MAX_JSON_DEPTH, MAX_SCHEMA_BYTES, json_depth, loads_bounded
from rayllm.protocol.protocol import ChatCompletionRequest
from rayllm.protocol.structured import guided_spec
from rayllm.protocol.tools import TOOL_FORMATS, hermes_call_text, plan_tools

MSG = [{"role": "user", "content": "hi"}]
DEEP = "[" * 5000 + "]" * 5000  # past the parser's own recursion limit


def nested_schema(depth: int) -> dict[str, Any]:
    """A valid JSON Schema `depth` levels deep as JSON (each anyOf is two: its object and its list)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"anyOf": [schema]}
    assert json_depth(schema) == depth
    return schema


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG} | kw)


def test_json_depth_and_loads_bounded():
    assert [json_depth(v) for v in (1, "x", [], {}, [[]], {"a": [1, {}]}, nested_schema(65))] == [0, 0, 1, 1, 2, 3, 65]
    fits = nested_schema(MAX_JSON_DEPTH - 1)
    assert loads_bounded(json.dumps(fits)) == fits
    for text in (json.dumps(nested_schema(MAX_JSON_DEPTH + 1)), DEEP, "[1,"):
        with pytest.raises(ValueError):
            loads_bounded(text)


TOO_DEEP = nested_schema(MAX_JSON_DEPTH + 1)


@pytest.mark.parametrize("body, param", [
    ({"guided_json": DEEP}, "guided_json"),
    ({"guided_json": json.dumps(TOO_DEEP)}, "guided_json"),  # valid JSON and a valid schema, too deep
    ({"guided_json": TOO_DEEP}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": TOO_DEEP}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "structural_tag", "format": TOO_DEEP}}, "response_format"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": DEEP}}, "structured_outputs.structural_tag"),
])
def test_nested_constraints_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        guided_spec(chat(**body))
    assert (e.value.status_code, e.value.param) == (400, param), e.value
    assert guided_spec(chat(guided_json=nested_schema(MAX_JSON_DEPTH - 1))) is not None  # as deep as allowed


def test_a_huge_structural_tag_is_refused_before_it_is_parsed():
    with pytest.raises(APIError) as e:  # parsing it first was a RecursionError
        guided_spec(chat(structured_outputs={"structural_tag": "[" * (MAX_SCHEMA_BYTES + 1)}))
    assert (e.value.status_code, e.value.param, e.value.code) == (
        400, "structured_outputs.structural_tag", "constraint_too_large")


@pytest.mark.parametrize("parameters", [DEEP, json.dumps(TOO_DEEP), TOO_DEEP])
def test_nested_tool_parameters_are_400s_naming_the_tool(parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(APIError) as e:
        plan_tools(chat(tools=tools), other_constraint=False)
    assert (e.value.status_code, e.value.param) == (400, "tools.0.function.parameters")


def test_nested_tool_call_text_stays_the_clients():
    """A model's (or a client's) call whose arguments nest too deep is text, as a malformed one is."""
    assert TOOL_FORMATS["hermes"].parse('{"name": "f", "arguments": ' + DEEP + "}") is None
    assert TOOL_FORMATS["hermes"].parse('{"name": "f", "arguments": {"a": [1]}}')[0].arguments == '{"a": [1]}'
    assert DEEP in hermes_call_text("f", DEEP)
    assert '"arguments": {"a": 1}' in hermes_call_text("f", '{"a": 1}')
