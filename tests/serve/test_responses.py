"""/v1/responses end to end through the OpenAI SDK, on real generation with the default model.

References: the SDK's own parsing (Response objects, the `responses.stream` helper's accumulation,
`responses.parse` into a pydantic model), the server's /tokenize of the same chat messages (what a
chained turn's input_tokens must equal), and jsonschema for structured output.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def concurrently(*calls):
    """The calls' results, in order, the calls sent at once: the session app batches them (batch-invariant, and
    a seeded draw does not depend on its batch: each answer is the one it would be alone) for a fraction of
    their cost one after another. The first exception a call raised is raised here."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _tokens(server, auth, model_name, messages) -> int:
    r = httpx.post(f"{server}/tokenize", json={"model": model_name, "messages": messages}, headers=auth)
    r.raise_for_status()
    return r.json()["count"]


def test_chain_with_previous_response_id(client, server, auth, model_name):
    first = "My name is Ada and I like tea. Say hello to me."
    r1 = client.responses.create(model=model_name, input=first, temperature=0, max_output_tokens=30)
    assert r1.status in ("completed", "incomplete") and r1.output_text
    assert r1.usage.input_tokens == _tokens(server, auth, model_name, [{"role": "user", "content": first}])
    r2 = client.responses.create(model=model_name, previous_response_id=r1.id, input="What is my name?",
                                 temperature=0, max_output_tokens=20, metadata={"topic": "names"})
    assert r2.previous_response_id == r1.id and r2.metadata == {"topic": "names"}
    # The second turn's prompt is the whole chain: exactly the tokens of the three messages rendered.
    chain = [{"role": "user", "content": first}, {"role": "assistant", "content": r1.output_text},
             {"role": "user", "content": "What is my name?"}]
    assert r2.usage.input_tokens == _tokens(server, auth, model_name, chain)
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens - 5
    # The first turn's prompt is a prefix of the second's: the prefix cache serves (part of) it.
    assert 0 < r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens
    assert r2.usage.total_tokens == r2.usage.input_tokens + r2.usage.output_tokens
    # Stored: the same body comes back, and its input items are the chain in order.
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text and got.usage == r2.usage
    assert got.metadata == {"topic": "names"}
    items = client.responses.input_items.list(r2.id, order="asc").data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", "user", first), ("message", "assistant", r1.output_text),
        ("message", "user", "What is my name?")]
    newest = client.responses.input_items.list(r2.id, limit=1)
    assert newest.data[0].content[0].text == "What is my name?" and newest.has_more


def test_instructions_are_the_system_message(client, server, auth, model_name):
    r = client.responses.create(model=model_name, instructions="Answer in French.", input="Hello!",
                                temperature=0, max_output_tokens=5)
    assert r.instructions == "Answer in French."
    assert r.usage.input_tokens == _tokens(server, auth, model_name, [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"}])


def test_streaming_events_match_the_whole_response(client, model_name):
    kw = dict(model=model_name, input="Write one sentence about the sea.", temperature=0, max_output_tokens=40)
    whole, events = concurrently(lambda: client.responses.create(**kw),
                                 lambda: list(client.responses.create(stream=True, **kw)))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done",
                                       "response.completed" if whole.status == "completed" else "response.incomplete"]
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == whole.output_text
    usage = events[-1].response.usage  # cached_tokens differ: the second run hits the prefix cache
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert events[-1].response.output_text == whole.output_text
    assert events[0].response.id == events[-1].response.id and events[0].response.status == "in_progress"
    # The SDK's stream helper accumulates the same events into the same final response.
    if whole.status == "completed":
        with client.responses.stream(**kw) as stream:
            snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert snapshots[-1] == final.output_text == whole.output_text


def test_function_tool_round_trip(client, model_name):
    ask = "What's the weather like in Paris?"
    r1 = client.responses.create(model=model_name, input=ask, tools=TOOLS, temperature=0, max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    result = {"city": json.loads(calls[0].arguments)["city"], "temperature_c": 18, "sky": "cloudy"}
    r2 = client.responses.create(model=model_name, previous_response_id=r1.id, tools=TOOLS, temperature=0,
                                 max_output_tokens=40, input=[{"type": "function_call_output",
                                                               "call_id": calls[0].call_id,
                                                               "output": json.dumps(result)}])
    assert r2.output_text and not [o for o in r2.output if o.type == "function_call"]
    items = client.responses.input_items.list(r2.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == items[2].call_id == calls[0].call_id and items[1].arguments == calls[0].arguments
    assert r2.usage.input_tokens > r1.usage.input_tokens  # the call and its output are in the prompt


def test_function_call_streams_its_arguments(client, model_name):
    kw = dict(model=model_name, input="What's the weather like in Rome?", tools=TOOLS, temperature=0,
              max_output_tokens=60, tool_choice="required")
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") \
        == "".join(e.arguments for e in done)
    call = next(o for o in final.output if o.type == "function_call")
    assert call.arguments == done[0].arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_structured_output(client, model_name, temperature):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=150)  # bounded, so a sampled answer always fits the tokens

    # An open JSON object has no length bound: sampled, it may outrun max_output_tokens (asked for greedy only).
    r, parsed, *obj = concurrently(
        lambda: client.responses.create(model=model_name, input="Describe a person named Bob as JSON.",
                                        temperature=temperature, max_output_tokens=80,
                                        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                         "strict": True}}),
        lambda: client.responses.parse(model=model_name, input="Describe a person named Bob.", text_format=Person,
                                       temperature=temperature, max_output_tokens=80),
        *([] if temperature else [lambda: client.responses.create(
            model=model_name, input="Reply with a JSON object with the keys name and age.", temperature=temperature,
            max_output_tokens=60, text={"format": {"type": "json_object"}})]))
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    assert isinstance(parsed.output_parsed, Person)
    if temperature:
        return
    assert isinstance(json.loads(obj[0].output_text), dict)


def test_conversation_and_store(client, server, auth, model_name):
    conv = client.conversations.create()
    r1 = client.responses.create(model=model_name, conversation=conv.id, input="Hi, I am Bo.", temperature=0,
                                 max_output_tokens=10)
    assert r1.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [("user", "Hi, I am Bo."), ("assistant", r1.output_text)]
    r2 = client.responses.create(model=model_name, conversation=conv.id, input="Who am I?", temperature=0,
                                 max_output_tokens=5, store=False)
    assert r2.usage.input_tokens == _tokens(server, auth, model_name, [
        {"role": "user", "content": "Hi, I am Bo."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "Who am I?"}])
    assert len(client.conversations.items.list(conv.id).data) == 4  # the turn is kept although store is false
    with pytest.raises(openai.NotFoundError):  # ... but not the response
        client.responses.retrieve(r2.id)


def test_turn_ids_match_the_conversation_and_item_references_resolve(client, client2, server, auth, model_name):
    """A turn's items keep their ids in its conversation (response.output, /input_items and the conversation
    list agree); item_reference input items name the key's stored items and are replaced by copies of them
    (the prompt is exactly theirs); an unknown or another key's id is a 400 naming it."""
    conv = client.conversations.create()
    r1 = client.responses.create(model=model_name, conversation=conv.id, input="Name a colour.", temperature=0,
                                 max_output_tokens=5)
    sent = client.responses.input_items.list(r1.id, order="asc").data
    stored = client.conversations.items.list(conv.id, order="asc").data
    assert [i.id for i in stored] == [i.id for i in sent] + [o.id for o in r1.output]
    answer = next(o for o in r1.output if o.type == "message")
    assert client.conversations.items.retrieve(answer.id, conversation_id=conv.id) == stored[-1]
    ask = "Repeat it."
    r2 = client.responses.create(model=model_name, temperature=0, max_output_tokens=3, input=[
        {"type": "item_reference", "id": sent[0].id}, {"type": "item_reference", "id": answer.id},
        {"role": "user", "content": ask}])
    assert r2.usage.input_tokens == _tokens(server, auth, model_name, [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": ask}])
    copies = client.responses.input_items.list(r2.id, order="asc").data
    assert [c.content[0].text for c in copies[:2]] == ["Name a colour.", r1.output_text]
    assert {c.id for c in copies}.isdisjoint({sent[0].id, answer.id})  # copies, each with an id of its own
    for who, ref in ((client, "msg_does_not_exist"), (client2, answer.id)):
        with pytest.raises(openai.BadRequestError) as exc:
            who.responses.create(model=model_name, max_output_tokens=3, input=[
                {"role": "user", "content": "x"}, {"type": "item_reference", "id": ref}])
        assert exc.value.body["param"] == "input.1.id"


def test_per_key_isolation(client, client2, model_name):
    r = client.responses.create(model=model_name, input="Secret of tenant one.", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client2.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client2.responses.create(model=model_name, previous_response_id=r.id, input="Tell me.", max_output_tokens=3)
    assert exc.value.body["param"] == "previous_response_id" and exc.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client2.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        client2.responses.delete(r.id)
    assert client.responses.retrieve(r.id).id == r.id  # untouched by the other tenant's delete
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.mark.parametrize("tools, named", [
    ([{"type": "web_search"}], ["web_search"]),
    ([{"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "computer_use_preview", "display_width": 1,
      "display_height": 1, "environment": "linux"}], ["file_search", "computer_use_preview"]),
])
def test_hosted_tools_are_refused(client, model_name, tools, named):
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=model_name, input="Search the web.", tools=tools)
    assert exc.value.body["param"] == "tools" and all(n in exc.value.body["message"] for n in named)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": "x"}] * 257}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c" * 200, "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_x", "conversation": "conv_x"}, "previous_response_id"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
])
def test_bounds_and_errors_name_the_field(server, auth, model_name, body, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": model_name} | body, headers=auth)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_missing_response_and_model_are_404s(client, model_name):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_does_not_exist")
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="no-such-model", input="x")
    assert exc.value.body["param"] == "model"


def test_responses_routes_need_a_key(server):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"), ("GET", "/v1/responses/resp_x/input_items")):
        r = httpx.request(method, f"{server}{path}", json={"input": "x"} if method == "POST" else None)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


def test_reasoning_items_from_a_thinking_model(client, model_name):
    """A model that thinks in <think> tags (the default model, taught by test_tools' template and history):
    its thought is a reasoning item before the message, equal to the chat API's reasoning_content, and
    streams as reasoning_text deltas."""
    from test_tools import THINK_TEMPLATE, THINKING

    kw = dict(model=model_name, input=THINKING, temperature=0, max_output_tokens=60,
              extra_body={"chat_template": THINK_TEMPLATE})
    chat, r, events = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=THINKING, temperature=0, max_tokens=60,
                                               extra_body={"chat_template": THINK_TEMPLATE}),
        lambda: client.responses.create(**kw), lambda: list(client.responses.create(stream=True, **kw)))
    expected = chat.choices[0].message
    assert expected.reasoning_content  # the reference really thought
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == expected.reasoning_content
    assert r.output_text == expected.content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == expected.reasoning_content


def test_truncation_auto_drops_the_oldest_turns_to_fit_the_context(client, server, auth, model_name):
    """OpenAI's truncation "auto": a chain past the context (the session app's 2,048 tokens) drops its oldest
    turns until it fits; the model then sees the instructions and the newest turn, exactly (the server's
    /tokenize of those messages). Without it the same request is a 400."""
    long_text = "Here are some notes. " + " ".join(f"Note {i}: the river is wide here." for i in range(150))
    first = client.responses.create(model=model_name, input=long_text, temperature=0, max_output_tokens=4)
    follow = long_text.replace("river", "road")
    kw = dict(model=model_name, previous_response_id=first.id, instructions="Answer briefly.", input=follow,
              temperature=0, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**kw)
    assert e.value.code == "context_length_exceeded"
    r = client.responses.create(truncation="auto", **kw)
    assert r.truncation == "auto" and r.output_text
    kept = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": follow}]
    assert r.usage.input_tokens == _tokens(server, auth, model_name, kept)
