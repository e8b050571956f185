"""Structured output from a model whose chat template opens <think> (DeepSeek-R1-distill, QwQ): the grammar
shapes the output from its first token, so what it shapes is the answer, and the OpenAI SDK parses it."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

# ChatML whose generation prompt opens the thought for the model, as R1-distill templates do.
OPENS_THINK = ("{% for message in messages %}"
               "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
ASK = [{"role": "user", "content": "Describe a person named Bob as JSON."}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int


def test_json_schema_output_is_the_answer_not_a_thought(client, model_name):
    r = client.chat.completions.parse(model=model_name, messages=ASK, temperature=0, max_tokens=80,
                                      response_format=Person, extra_body={"chat_template": OPENS_THINK})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Person) and msg.parsed == Person.model_validate_json(msg.content)
    assert not getattr(msg, "reasoning_content", None)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_is_made_when_the_template_opens_think(client, model_name, stream):
    kw = dict(model=model_name, temperature=0, max_tokens=80, tools=WEATHER, tool_choice="required",
              messages=[{"role": "user", "content": "What's the weather in Paris?"}],
              extra_body={"chat_template": OPENS_THINK})
    if stream:
        with client.chat.completions.stream(**kw) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
