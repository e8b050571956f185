"""Tool calling and reasoning end to end, on real generation with the default model. (Llama 3.x's own tool
format, on a tiny model with Llama 3.1's chat template, is tested in test_model_families.py, whose app serves it.)"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                      "parameters": TIME_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What's the weather like in Paris?"}]


def _call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


# A conversation whose history shows the model calling the tool (rendered in the Hermes format that
# SmolLM2's template lacks): the model then calls it on its own, so `auto` parsing sees real output.
FEW_SHOT = [{"role": "user", "content": "What's the weather in London?"}, _call("London", 1),
            {"role": "user", "content": "And in Berlin?"}, _call("Berlin", 2),
            {"role": "user", "content": "And in Paris?"}]


def concurrently(*calls):
    """The calls' results, in order, the calls sent at once: the session app batches them (batch-invariant, and
    a seeded draw does not depend on its batch: each answer is the one it would be alone) for a fraction of
    their cost one after another. The first exception a call raised is raised here."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _check_calls(calls, expect_name=None):
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        assert expect_name is None or c.function.name == expect_name
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_required_and_named_tool_choice(client, model_name, temperature):
    required, r = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="required",
                                               temperature=temperature, seed=1, max_tokens=150),
        lambda: client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, temperature=temperature,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               seed=1, max_tokens=100))
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    assert r.choices[0].finish_reason == "stop"  # a call forced by name: OpenAI's and vLLM's answer
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls, "get_time")


def test_required_without_parallel_calls_gives_exactly_one(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0.8, seed=4, max_tokens=150)
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls)


def test_auto_parses_the_models_own_tool_call(client, model_name):
    r, none = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=FEW_SHOT, tools=TOOLS, temperature=0,
                                               max_tokens=60),
        lambda: client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, tool_choice="none",
                                               temperature=0, max_tokens=30))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    _check_calls(choice.message.tool_calls, "get_weather")
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    # tool_choice none: no tools offered, no calls parsed
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize("kwargs", [
    {"messages": FEW_SHOT, "tool_choice": "auto", "max_tokens": 60},
    {"messages": ASK, "tool_choice": "required", "max_tokens": 150},
    {"messages": ASK, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 100},
])
def test_tool_calls_stream_in_openai_shape(client, model_name, kwargs):
    whole, chunks = concurrently(
        lambda: client.chat.completions.create(model=model_name, tools=TOOLS, temperature=0, **kwargs),
        lambda: list(client.chat.completions.create(model=model_name, tools=TOOLS, temperature=0, stream=True,
                                                    **kwargs)))
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call carries its id, type and name
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert finish == whole.choices[0].finish_reason == ("stop" if isinstance(kwargs["tool_choice"], dict)
                                                        else "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]


def test_legacy_functions_answer_with_function_call(server, auth, model_name):
    body = {"model": model_name, "messages": ASK, "temperature": 0, "max_tokens": 100,
            "functions": [t["function"] for t in TOOLS], "function_call": {"name": "get_weather"}}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=auth, timeout=60).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]  # forced by name
    assert choice["message"]["function_call"]["name"] == "get_weather"
    jsonschema.validate(json.loads(choice["message"]["function_call"]["arguments"]), WEATHER_PARAMS)


def test_tool_history_round_trip(client, model_name):
    messages = [*ASK, _call("Paris", 9),
                {"role": "tool", "tool_call_id": "call_9", "content": json.dumps({"temperature_c": 21})}]
    r = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(server, auth, model_name, body, param):
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60,
                   json={"model": model_name, "messages": ASK, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- reasoning ----------------------------------------------------------------------------------

# A chat-template fixture for a "thinking" model: plain ChatML that mentions <think>, with a history whose
# answers think first, so that the default model's real output contains think tags.
THINK_TEMPLATE = ("{# thinking model: answers start with <think> #}{% for message in messages %}"
                  "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
THINKING = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\nThe answer is 4."},
            {"role": "user", "content": "What is 3+3?"},
            {"role": "assistant", "content": "<think>\nThree plus three is six.\n</think>\nThe answer is 6."},
            {"role": "user", "content": "What is 3+5?"}]


@pytest.fixture(scope="module")
def reasoned(client, model_name):
    """The thinking conversation's answer with its reasoning separated (the default): the reference that the
    reasoning tests below compare their other spellings of the same greedy request with."""
    return client.chat.completions.create(model=model_name, messages=THINKING, temperature=0, max_tokens=60,
                                          extra_body={"chat_template": THINK_TEMPLATE})


def test_reasoning_is_separated(client, model_name, reasoned):
    # vLLM's include_reasoning: false drops the thought from the answer altogether, streamed or not
    kw = dict(model=model_name, messages=THINKING, temperature=0, max_tokens=60,
              extra_body={"chat_template": THINK_TEMPLATE, "include_reasoning": False})
    plain, dropped, chunks = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=THINKING, temperature=0, max_tokens=60,
                                               extra_body={"chat_template": THINK_TEMPLATE,
                                                           "separate_reasoning": False}),
        lambda: client.chat.completions.create(**kw).choices[0].message,
        lambda: [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kw) if c.choices])
    raw = plain.choices[0].message.content
    assert raw.startswith("<think>") and "</think>" in raw  # the model really thinks in tags
    msg = reasoned.choices[0].message
    thought, answer = raw[len("<think>"):].split("</think>", 1)
    assert msg.reasoning_content == thought and msg.content == answer.lstrip("\n")
    assert "<think>" not in msg.content
    assert getattr(dropped, "reasoning_content", None) is None and dropped.content == msg.content
    assert not any(getattr(d, "reasoning_content", None) for d in chunks)
    assert "".join(d.content or "" for d in chunks) == msg.content


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_reasoning_streams(client, model_name, reasoned, stream_reasoning):
    whole = reasoned
    chunks = list(client.chat.completions.create(
        model=model_name, messages=THINKING, temperature=0, max_tokens=60, stream=True,
        extra_body={"chat_template": THINK_TEMPLATE, "stream_reasoning": stream_reasoning}))
    reasoning = [c.choices[0].delta.reasoning_content for c in chunks
                 if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(reasoning) == whole.choices[0].message.reasoning_content
    assert content == whole.choices[0].message.content
    assert (len(reasoning) > 1) == stream_reasoning  # streamed piece by piece, or sent whole once done


def test_reasoning_goes_by_vllms_name_too(client, model_name, reasoned):
    """vLLM now calls the thought `reasoning`: answers carry it beside reasoning_content (the same text, whole or
    streamed), and an assistant turn that brings its thought back under that name is accepted."""
    kw = dict(model=model_name, temperature=0, max_tokens=60, extra_body={"chat_template": THINK_TEMPLATE})
    msg = reasoned.choices[0].message  # the same request as kw's
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"] and msg.model_extra["reasoning"]
    history = [*THINKING, {"role": "assistant", "content": msg.content, "reasoning": msg.model_extra["reasoning"]},
               {"role": "user", "content": "And 1+1?"}]
    streamed, again = concurrently(
        lambda: [c.choices[0].delta.model_extra for c in client.chat.completions.create(messages=THINKING,
                                                                                        stream=True, **kw)
                 if c.choices and c.choices[0].delta.model_extra],
        lambda: client.chat.completions.create(messages=history, **kw))
    assert all(x["reasoning"] == x["reasoning_content"] for x in streamed)
    assert "".join(x["reasoning"] for x in streamed) == msg.model_extra["reasoning"]
    assert again.choices[0].message.content


def test_reasoning_switches_reach_the_template(server, auth, model_name):
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking %} thinking is on{% endif %}{{ ' effort ' + reasoning_effort if reasoning_effort }}")
    body = {"model": model_name, "messages": [{"role": "user", "content": "x"}], "chat_template": template,
            "max_tokens": 1}

    def prompt_tokens(**extra) -> int:
        r = httpx.post(f"{server}/v1/chat/completions", json=body | extra, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    off, on, effort, kwargs_on = concurrently(
        prompt_tokens, lambda: prompt_tokens(enable_thinking=True), lambda: prompt_tokens(reasoning_effort="low"),
        lambda: prompt_tokens(chat_template_kwargs={"enable_thinking": True}))
    assert on > off
    assert effort > off
    assert kwargs_on == on
