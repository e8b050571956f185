"""The Responses API's request side: input items -> stored items -> chat messages, the chat request, bounds.

References: the server's own ChatCompletionRequest (the converted request must validate as one) and
the chat messages a client would have sent for the same conversation.
"""

from __future__ import annotations

import json
import typing

import pytest
from openai.types.responses import ResponseIncludable
from pydantic import ValidationError

from rayllm.protocol import protocol as P
from rayllm.protocol import responses_api as R
from rayllm.protocol.errors import APIError, from_validation_error
from rayllm.protocol.messages import text_of

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def create(**body) -> R.ResponseCreate:
    return R.ResponseCreate.model_validate({"input": "hi"} | body)


def test_string_input_is_one_user_message():
    items = R.input_items(create(input="Hello"))
    assert [(i["type"], i["role"], i["content"]) for i in items] == [
        ("message", "user", [{"type": "input_text", "text": "Hello"}])]
    assert items[0]["id"].startswith("msg_")


def test_items_become_the_chat_messages_a_client_would_send():
    req = create(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thinking"}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20C"}]},
    ])
    messages = R.items_to_messages(R.input_items(req))
    call = lambda i, city: {"id": f"call_{i}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    assert messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": text_of([{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}])},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call(1, "Paris"), call(2, "Lyon")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
    ]
    chat = R.chat_request(req, messages)
    assert [m.role for m in chat.messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert chat.messages[2].tool_calls[1].function.arguments == '{"city": "Lyon"}'


def test_text_parts_join_as_chats_do():
    """Two text parts are two lines, in the stored item and in the prompt, as chat's text_of (vLLM's "string"
    content format) makes of the same parts, whether the item comes in or was stored with several parts."""
    parts = [{"type": "input_text", "text": "first"}, {"type": "input_text", "text": "second"}]
    chat = text_of([{"type": "text", "text": "first"}, {"type": "text", "text": "second"}])
    assert chat == "first\nsecond"
    stored = R.input_items(create(input=[{"role": "user", "content": parts}]))
    assert stored[0]["content"] == [{"type": "input_text", "text": chat}]
    several = {"type": "message", "role": "user", "content": parts}
    assert R.items_to_messages([several]) == [{"role": "user", "content": chat}]


def test_include_takes_what_this_server_adds_and_refuses_the_rest_by_name():
    """Of the values OpenAI's SDK types for `include`, only the output text's logprobs are made here; the
    others (hosted tools' results, images, encrypted reasoning) and unknown strings are a 400 naming include."""
    R.check_supported(create(include=[R.LOGPROBS_INCLUDE]))
    others = [v for v in typing.get_args(ResponseIncludable) if v != R.LOGPROBS_INCLUDE]
    assert R.LOGPROBS_INCLUDE in typing.get_args(ResponseIncludable) and "reasoning.encrypted_content" in others
    for value in [*others, "not.a.value"]:
        with pytest.raises(APIError) as exc:
            R.check_supported(create(include=[R.LOGPROBS_INCLUDE, value]))
        assert (exc.value.status_code, exc.value.param, exc.value.code) == (400, "include", "unsupported_value")
        assert repr(value) in exc.value.message


def test_a_call_without_text_opens_its_own_assistant_message():
    items = R.input_items(create(input=[
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
    assert R.items_to_messages(items)[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_chat_request_carries_every_option():
    req = create(model="base:adapter", temperature=0.3, top_p=0.9, max_output_tokens=7, stream=True,
                 tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
                 tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                 reasoning={"effort": "low"}, include=[R.LOGPROBS_INCLUDE], top_logprobs=2)
    chat = R.chat_request(req, [{"role": "user", "content": "hi"}])
    assert (chat.model, chat.temperature, chat.top_p, chat.max_completion_tokens, chat.stream) == \
        ("base:adapter", 0.3, 0.9, 7, True)
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.parallel_tool_calls, chat.reasoning_effort, chat.logprobs, chat.top_logprobs) == (False, "low", True, 2)
    assert chat.store is False  # the Responses route stores on its own


@pytest.mark.parametrize("body, engine_priority", [
    ({}, 0), ({"service_tier": "flex"}, 1), ({"service_tier": "priority"}, -1), ({"priority": 5}, 5),
    ({"priority": -3, "service_tier": "flex"}, -3),  # an explicit priority wins, as on chat
])
def test_priority_and_service_tier_reach_the_engine(body, engine_priority):
    chat = R.chat_request(create(**body), [{"role": "user", "content": "hi"}])
    assert P.to_sampling_params(chat, prompt_len=3, max_model_len=64).priority == engine_priority


@pytest.mark.parametrize("fmt, expect", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}),
])
def test_text_format_becomes_response_format(fmt, expect):
    got = R.chat_request(create(text={"format": fmt}), [{"role": "user", "content": "x"}]).response_format
    assert (got.model_dump(exclude_none=True) if got else None) == expect


@pytest.mark.parametrize("tools, words", [
    ([{"type": "web_search"}], ["web_search"]),
    ([{"type": "function", "name": "f"}, {"type": "file_search"}, {"type": "computer_use_preview"}],
     ["file_search", "computer_use_preview"]),
])
def test_hosted_tools_are_refused_by_name(tools, words):
    with pytest.raises(APIError) as exc:
        R.chat_tools(tools)
    assert exc.value.param == "tools" and all(w in exc.value.message for w in words)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": "x"}] * (R.MAX_INPUT_ITEMS + 1)}, "input"),
    ({"input": "x" * (R.MAX_TEXT_CHARS + 1)}, "input"),
    ({"instructions": "x" * (R.MAX_TEXT_CHARS + 1)}, "instructions"),
    ({"tools": [{"type": "function", "name": "f"}] * (R.MAX_TOOLS + 1)}, "tools"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"include": ["x"] * 17}, "include"),
    ({"priority": 10**7}, "priority"),
    ({"service_tier": "fastest"}, "service_tier"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_request_bounds_name_the_field(body, param):
    with pytest.raises(ValidationError) as exc:
        create(**body)
    assert from_validation_error(exc.value).param == param


@pytest.mark.parametrize("item, param", [
    ({"role": "tool", "content": "x"}, "input.0.role"),
    ({"role": "user", "content": [{"type": "input_text", "text": "x"}] * (R.MAX_PARTS + 1)}, "input.0.content"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input.0.content.0.type"),
    ({"role": "user", "content": 3}, "input.0.content"),
    ({"type": "function_call", "call_id": "", "name": "f"}, "input.0.call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "x" * (R.MAX_TEXT_CHARS + 1)},
     "input.0.arguments"),
    ({"type": "function_call_output", "call_id": "c", "output": 5}, "input.0.output"),
    ({"type": "file_search_call", "id": "fs"}, "input.0.type"),
])
def test_item_bounds_name_the_field(item, param):
    with pytest.raises(APIError) as exc:
        R.input_items(create(input=[item]))
    assert exc.value.status_code == 400 and exc.value.param == param


def test_unsupported_options_and_renamed_errors():
    R.check_supported(create(truncation="auto"))  # works: the oldest turns are dropped to fit
    for body, param in (({"background": True}, "background"),
                        ({"previous_response_id": "resp_1", "conversation": "conv_1"}, "previous_response_id")):
        with pytest.raises(APIError) as exc:
            R.check_supported(create(**body))
        assert exc.value.param == param
    err = R.renamed(APIError(400, "'max_completion_tokens' is too large: 9", param="max_completion_tokens"))
    assert err.param == "max_output_tokens" and "'max_output_tokens'" in err.message
    with pytest.raises(APIError) as exc:
        R.chat_tool_choice({"type": "web_search_preview"})
    assert exc.value.param == "tool_choice"
    with pytest.raises(APIError) as exc:
        R.chat_response_format(R.TextConfig.model_validate({"format": {"type": "json_schema", "name": "x"}}))
    assert exc.value.param == "text.format.schema"


def test_truncation_keeps_the_instructions_and_drops_whole_turns():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert R.turn_starts(msgs) == (1, [1, 5])  # a cut only where a user turn starts: tool calls keep outputs
    assert R.turn_starts([{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]) == (0, [1])


def test_item_references_become_copies_with_ids_of_their_own(monkeypatch):
    items = R.input_items(create(input=[{"type": "item_reference", "id": "fc_1"}, {"id": "msg_2"},  # type optional
                                        {"role": "user", "content": "x"}]))
    assert R.reference_ids(items) == {"fc_1", "msg_2"}
    known = {"fc_1": {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "c", "name": "f",
                      "arguments": "{}"}, "msg_2": R.message_item("assistant", "a", "msg_2")}
    out = R.resolve_references(items, known)
    assert [o | {"id": None} for o in out[:2]] == [known["fc_1"] | {"id": None}, known["msg_2"] | {"id": None}]
    assert out[0]["id"].startswith("fc_") and out[1]["id"].startswith("msg_") and out[2] == items[2]
    assert not {o["id"] for o in out} & {"fc_1", "msg_2"}  # ids stay unique: the copy can be stored too
    with pytest.raises(APIError) as exc:  # missing, or another key's: not among the owner's items
        R.resolve_references(items, {"fc_1": known["fc_1"]})
    assert exc.value.status_code == 400 and exc.value.param == "input.1.id"
    monkeypatch.setattr(R, "MAX_REFERENCED_CHARS", 150)  # references may not multiply a request's size
    with pytest.raises(APIError) as exc:
        R.resolve_references(items, known)
    assert exc.value.param == "input"
    with pytest.raises(APIError) as exc:
        R.input_items(create(input=[{"type": "item_reference", "id": 7}]))
    assert exc.value.param == "input.0.id"


def test_reasoning_options_the_sdk_types():
    """OpenAI's SDK types reasoning.effort "max", reasoning.context and reasoning.mode: what this server does
    is accepted (effort passed on; past reasoning items are not replayed, so context auto / current_turn;
    the standard mode); the rest is a 400 naming the field and saying why."""
    req = create(reasoning={"effort": "max", "context": "current_turn", "mode": "standard"})
    R.check_supported(req)
    assert R.chat_request(req, [{"role": "user", "content": "hi"}]).reasoning_effort == "max"
    assert P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                   "reasoning_effort": "max"}).reasoning_effort == "max"
    R.check_supported(create(reasoning={"context": "auto"}))
    for reasoning, param, words in (({"context": "all_turns"}, "reasoning.context", "not replayed"),
                                    ({"mode": "pro"}, "reasoning.mode", "'standard' mode only")):
        with pytest.raises(APIError) as exc:
            R.check_supported(create(reasoning=reasoning))
        assert (exc.value.status_code, exc.value.param) == (400, param) and words in exc.value.message
