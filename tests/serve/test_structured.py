"""Structured output end to end: every constraint spelling yields output that parses and validates."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

PERSON = [{"role": "user", "content": "Give me a JSON object describing a person named Bob."}]
# With no schema a 135M model can nest keys until max_tokens; this prompt keeps its objects short.
BOB = [{"role": "user", "content": "Reply with a JSON object with the keys name and age for a person called Bob."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                   "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TEMPS = [0.0, 0.8]


def _schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", TEMPS)
def test_json_schema_output_validates(client, model_name, temperature):
    r = client.chat.completions.create(model=model_name, messages=PERSON, temperature=temperature, seed=7,
                                       max_tokens=120, response_format=_schema_format())
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("temperature", TEMPS)
def test_json_object_is_an_object(client, model_name, temperature):
    r = client.chat.completions.create(model=model_name, messages=BOB, temperature=temperature, seed=3,
                                       max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("temperature", TEMPS)
def test_json_schema_streaming_reassembles(client, model_name, temperature):
    stream = client.chat.completions.create(model=model_name, messages=PERSON, temperature=temperature, seed=11,
                                            max_tokens=120, response_format=_schema_format(), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("body,check", [
    ({"regex": r"(yes|no), because [a-z ]{3,30}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{3,30}\.", t)),
    ({"guided_regex": r"[A-Z][a-z]{2,10}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,10}", t)),
    ({"ebnf": 'root ::= "The answer is " digit "."\ndigit ::= [0-9]'},
     lambda t: re.fullmatch(r"The answer is [0-9]\.", t)),
    ({"guided_grammar": 'root ::= ("red" | "green" | "blue") " " ("car" | "house")'},
     lambda t: re.fullmatch(r"(red|green|blue) (car|house)", t)),
    ({"guided_choice": ["Paris", "London", "Rome"]}, lambda t: t in ("Paris", "London", "Rome")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    # vLLM's newer spelling of the same constraints
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}, lambda t: t in ("Paris", "London", "Rome")),
    ({"response_format": {"type": "regex", "regex": r"\d{3}-\d{4}"}}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
])
@pytest.mark.parametrize("temperature", TEMPS)
def test_other_constraints(client, model_name, body, check, temperature):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Answer briefly."}],
                                       temperature=temperature, seed=5, max_tokens=80, extra_body=body)
    text = r.choices[0].message.content
    assert check(text), text


@pytest.mark.parametrize("temperature", TEMPS)
def test_completions_json_schema_string_and_response_format(client, model_name, temperature):
    r = client.completions.create(model=model_name, prompt="A person as JSON:", temperature=temperature, seed=2,
                                  max_tokens=120, extra_body={"json_schema": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=model_name, prompt="Pick a colour:", temperature=temperature, seed=2,
                                  max_tokens=10, extra_body={"guided_choice": ["red", "green"]})
    assert r.choices[0].text in ("red", "green")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": 5}}}}, "guided_json", "not a valid JSON Schema"),
    ({"regex": "[a-"}, "regex", "regex"),
    ({"ebnf": 'root ::= "a" | '}, "ebnf", "ebnf"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"regex": "a+", "guided_choice": ["x"]}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
])
def test_invalid_constraints_are_400s(server, auth, model_name, body, param, words):
    for stream in (False, True):
        r = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60, json={
            "model": model_name, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"].startswith(param) and words.lower() in err["message"].lower(), err
    ok = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60, json={
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert ok.status_code == 200


async def test_constrained_and_unconstrained_batched_together(server, auth, client, model_name):
    from openai import AsyncOpenAI

    free = [{"role": "user", "content": "Write one sentence about the sea."}]
    alone = client.chat.completions.create(model=model_name, messages=free, temperature=0, max_tokens=40)
    async with AsyncOpenAI(base_url=f"{server}/v1", api_key=auth["Authorization"][7:], max_retries=0, timeout=120) as aclient:
        *constrained, unconstrained = await asyncio.gather(
            *[aclient.chat.completions.create(model=model_name, messages=PERSON, temperature=0.8, seed=i,
                                              max_tokens=120, response_format=_schema_format())
              for i in range(4)],
            aclient.chat.completions.create(model=model_name, messages=free, temperature=0, max_tokens=40),
        )
    for r in constrained:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert unconstrained.choices[0].message.content == alone.choices[0].message.content


def test_repeated_schema_compiles_once(client, model_name, llm_stats):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}
    fmt = _schema_format(schema)
    client.chat.completions.create(model=model_name, messages=PERSON, max_tokens=20, response_format=fmt)
    before = llm_stats()["grammars_compiled"]
    for _ in range(3):
        r = client.chat.completions.create(model=model_name, messages=PERSON, max_tokens=20, response_format=fmt)
        assert json.loads(r.choices[0].message.content)["colour"] in ("red", "blue")
    assert llm_stats()["grammars_compiled"] == before
