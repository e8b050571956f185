"""JSON-schema keywords the grammar engine would not enforce are 400s naming where they are
(rayllm.protocol.schema_support); realistic schemas (OpenAI's examples, pydantic v2's output) pass. That xgrammar
really lets output break each refused schema: tests/sample/test_unenforced_schemas.py."""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from rayllm.protocol.errors import APIError
from rayllm.protocol.protocol import ChatCompletionRequest
from rayllm.protocol.request_models import json_size
from rayllm.protocol.structured import guided_spec
from rayllm.protocol.tools import plan_tools
from tests.protocol.test_grammar_bounds import MATH, PROFILE, UI, WEATHER_TOOL

MSG = [{"role": "user", "content": "hi"}]
PARAM = "response_format.json_schema.schema"

# (schema, where the refused keyword is, words of the message), one per thing xgrammar would not enforce.
REFUSED: list[tuple[Any, str, str]] = [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "properties/a", "`not`"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "the top level", "`if`"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]},
     "the top level", "`properties`, `type` beside `allOf`"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "the top level", "`allOf` of more than one"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
     "the top level", "beside `anyOf`"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "minimum": 5}, "the top level", "`minimum` beside `$ref`"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "the top level", "may overlap"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "the top level", "may overlap"),
    ({"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.01}}}, "properties/x",
     "integers only"),
    ({"type": "integer", "multipleOf": 2.5}, "the top level", "whole number"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, "the top level", "only a lower or only an upper"),
    ({"$ref": "https://example.com/schema.json"}, "the top level", "only references inside the schema"),
    ({"$ref": "#foo", "$defs": {"A": {"$anchor": "foo", "type": "integer"}}}, "the top level", "`$ref` \"#foo\""),
    ({"$dynamicRef": "#/$defs/A", "$defs": {"A": {"type": "integer"}}}, "the top level", "`$dynamicRef`"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentSchemas": {"a": {"required": ["b"]}}},
     "the top level", "`dependentSchemas`"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "the top level", "`uniqueItems: true`"),
    ({"type": "string", "format": "email", "maxLength": 3}, "the top level", "`maxLength` beside `format`"),
    ({"type": "string", "pattern": "a+", "maxLength": 2}, "the top level", "`maxLength` beside `pattern`"),
    ({"type": "string", "format": "date", "pattern": "2.*"}, "the top level", "`pattern` beside `format`"),
    # Where a $ref leads counts, even outside $defs.
    ({"type": "object", "properties": {"p": {"$ref": "#/components/X"}}, "components": {"X": {"not": {}}}},
     "components/X", "`not`"),
    ({"type": "array", "items": {"$ref": "#/$defs/Item"},
      "$defs": {"Item": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                                 "uniqueItems": True}}}}},
     "$defs/Item/properties/tags", "`uniqueItems: true`"),
]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG} | kw)


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(("schema", "where", "words"), REFUSED)
def test_what_the_grammar_would_not_enforce_is_a_400_naming_where(schema, where, words):
    with pytest.raises(APIError) as e:
        guided_spec(chat(response_format=schema_format(schema)))
    assert (e.value.status_code, e.value.param, e.value.code) == (400, PARAM, "unsupported_schema"), e.value
    assert e.value.message.startswith(f"{PARAM} cannot be enforced at {where}: "), e.value.message
    assert words in e.value.message, e.value.message


@pytest.mark.parametrize("body", [lambda s: {"guided_json": s}, lambda s: {"structured_outputs": {"json": s}},
                                  lambda s: {"guided_json": json.dumps(s)}])
def test_every_schema_constraint_field_is_checked(body):
    with pytest.raises(APIError) as e:
        guided_spec(chat(**body({"not": {}})))
    assert e.value.code == "unsupported_schema" and "`not`" in e.value.message


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Address(BaseModel):
    city: str
    zip: str | None = None


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool = True


class Person(BaseModel):
    name: str = Field(description="the name", max_length=20)
    age: int = Field(ge=0)
    color: Color = Color.red
    home: Address = Field(description="where")
    other: Address | None = None
    tags: list[str] = Field(default_factory=list, max_length=3)
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    pets: list[Cat | Dog] = []
    even: int = Field(default=0, multiple_of=2)
    parent: Person | None = None


# Realistic: OpenAI's structured-output examples, a tool's parameters, pydantic v2's output for nested models,
# enums, optionals, a discriminated union, a recursive model; disjoint oneOf; names that are keywords.
ACCEPTED: list[Any] = [
    MATH, UI, PROFILE, WEATHER_TOOL, Person.model_json_schema(),
    {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
    {"oneOf": [{"const": "a"}, {"const": "b"}]},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {"$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}}, "$ref": "#/$defs/A",
     "type": "object", "description": "a type the reference has already"},
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "string"},
                                      "uniqueItems": {"type": "boolean", "default": True}},
     "required": ["not"], "examples": [{"not": "x", "if": "y"}]},
    {"type": "object", "properties": {"q": {"enum": [{"not": 1}, {"$ref": "https://x"}]}}},
    {"type": "object", "dependentRequired": {"a": ["b"]}, "properties": {"a": {"type": "string"}}},
    {"type": "string", "minLength": 1, "maxLength": 5},
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_realistic_schemas_pass(schema):
    spec = guided_spec(chat(response_format=schema_format(schema)))
    assert spec is not None and json.loads(spec.value) == schema


def test_a_pydantic_model_with_a_float_step_is_refused_where_the_step_is():
    class Price(BaseModel):
        amount: float = Field(multiple_of=0.01)

    with pytest.raises(APIError) as e:
        guided_spec(chat(response_format=schema_format(Price.model_json_schema())))
    assert "at properties/amount: `multipleOf` is supported on integers only" in e.value.message


def test_tool_parameters_are_not_refused():
    """A tool's parameters are the client's description of its function (OpenAI accepts any schema there unless
    strict): rich schemas stay accepted for tools (checked for validity and bounds only)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": REFUSED[0][0]}}]
    assert plan_tools(chat(tools=tools, tool_choice="auto"), other_constraint=False) is not None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "g"}}])
def test_forced_tool_arguments_are_checked_as_output_constraints(choice):
    """`required` and a named choice promise arguments that satisfy the tool's schema (its grammar forces them):
    what the grammar would not enforce is a 400 naming that tool's parameters, as for response_format."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "parameters": REFUSED[0][0]}}]
    with pytest.raises(APIError) as e:
        plan_tools(chat(tools=tools, tool_choice=choice), other_constraint=False)
    assert e.value.code == "unsupported_schema" and e.value.param == "tools.1.function.parameters"


def test_a_responses_text_format_schema_is_checked_under_its_own_name():
    from rayllm.protocol.responses_api import TextConfig, chat_response_format

    with pytest.raises(APIError) as e:
        chat_response_format(TextConfig.model_validate({"format": {"type": "json_schema", "name": "x",
                                                                   "schema": REFUSED[0][0]}}))
    assert e.value.code == "unsupported_schema" and e.value.param == "text.format.schema"


def test_a_oneof_as_large_as_a_schema_may_be_is_checked_in_linear_time(monkeypatch):
    """Near the 64 KiB bound on a schema: pair by pair, thousands of branches would take minutes. Counted, not
    timed: each branch's values are read a bounded number of times, and no branch is compared with another."""
    from rayllm.protocol import schema_support

    reads = {"values": 0, "tags": 0}
    for name in reads:
        real = getattr(schema_support, f"_{name}")
        monkeypatch.setattr(schema_support, f"_{name}", lambda node, _real=real, _name=name: (
            reads.__setitem__(_name, reads[_name] + 1), _real(node))[1])
    for schema in ({"oneOf": [{"const": i} for i in range(4000)]},
                   {"oneOf": [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"]}
                              for i in range(850)]}):
        assert json_size(schema) > 50_000
        branches = len(schema["oneOf"])
        reads.update(values=0, tags=0)
        assert guided_spec(chat(response_format=schema_format(schema))) is not None
        assert 0 < reads["values"] + reads["tags"] <= 3 * branches, reads
