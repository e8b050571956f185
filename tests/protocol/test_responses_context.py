"""The checks on a Responses request's whole context (rayllm/protocol/responses_context.py), on items made by
the protocol's own functions. References: OpenAI's answers to the same inputs (its error messages "Duplicate
item found with id ...", "No tool call found for function call output with call_id ...", "No tool output
found for function call ..."), and the stored JSON the bounds count (json.dumps of each item)."""

from __future__ import annotations

import json

import pytest

from rayllm.protocol import limits
from rayllm.protocol import responses_api as R
from rayllm.protocol import responses_context as RC
from rayllm.protocol.errors import APIError


def create(**body) -> R.ResponseCreate:
    return R.ResponseCreate.model_validate({"input": "hi"} | body)


def call(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": "{}"}


def output(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "18C"}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as exc:
        fn(*args)
    assert exc.value.status_code == 400
    return exc.value


def test_item_chars_count_the_stored_json():
    items = R.input_items(create(input=[user("héllo"), call("c1")]))
    assert RC.item_chars(items) == sum(len(json.dumps(it)) for it in items) and RC.item_chars([]) == 0


def test_a_chain_is_bounded_in_characters():
    RC.check_chain("resp_1", limits.MAX_CONTEXT_CHARS)
    err = refused(RC.check_chain, "resp_1", limits.MAX_CONTEXT_CHARS + 1)
    assert (err.param, err.code) == ("previous_response_id", "context_too_large") and "resp_1" in err.message


def test_a_stored_turn_reserves_its_input_and_an_allowance_for_its_output():
    plain = create(input="q")
    items = R.input_items(plain)
    assert RC.turn_room(plain, items) == (3, RC.item_chars(items) + limits.TURN_OUTPUT_CHARS)  # no token bound
    short = create(input="q", max_output_tokens=10)
    assert RC.turn_room(short, items) == (3, RC.item_chars(items) + 2 * limits.OUTPUT_ITEM_CHARS
                                          + 10 * limits.OUTPUT_TOKEN_CHARS)
    logprobs = create(input="q", max_output_tokens=10, include=[R.LOGPROBS_INCLUDE], top_logprobs=2)
    assert RC.turn_room(logprobs, items)[1] == RC.turn_room(short, items)[1] + 10 * 3 * limits.LOGPROB_ENTRY_CHARS
    tools = create(input="q", max_output_tokens=10**6, tools=[{"type": "function", "name": "f"}])
    assert RC.turn_room(tools, items) == (1 + R.MAX_TURN_OUTPUT_ITEMS, RC.item_chars(items) + limits.TURN_OUTPUT_CHARS)


def test_an_item_of_the_context_sent_again_is_a_duplicate():
    history = [R.message_item("user", "hi", "msg_1"), R.message_item("assistant", "hello", "msg_2")]
    RC.check_unique("a string input", history)
    RC.check_unique([user("next"), {"id": "msg_other", "role": "user", "content": "x"}], history)
    for raw, index in (([{"type": "item_reference", "id": "msg_2"}], 0),  # a reference to the history's item
                       ([user("x"), history[1]], 1),  # the item itself, with its id
                       ([{"id": "msg_9"}, {"type": "item_reference", "id": "msg_9"}], 1)):  # twice in the input
        err = refused(RC.check_unique, raw, history)
        assert err.param == f"input.{index}.id" and err.message == f"Duplicate item found with id {raw[index]['id']}."


def test_a_tool_output_answers_a_call_made_before_it():
    history = R.input_items(create(input=[user("weather?"), call("c1")]))
    RC.check_tool_outputs(history, R.input_items(create(input=[output("c1")])))
    RC.check_tool_outputs([], R.input_items(create(input=[user("q"), call("c2"), output("c2"), user("thanks")])))
    err = refused(RC.check_tool_outputs, history, R.input_items(create(input=[output("c1"), output("nope")])))
    assert err.param == "input.1.call_id"
    assert err.message == "No tool call found for function call output with call_id nope."
    err = refused(RC.check_tool_outputs, [], R.input_items(create(input=[output("c1"), call("c1")])))
    assert err.param == "input.0.call_id"  # the output came before its call


def test_a_user_message_while_a_call_is_unanswered_is_refused():
    history = R.input_items(create(input=[user("weather?"), call("c1"), call("c2"), output("c2")]))
    err = refused(RC.check_tool_outputs, history, R.input_items(create(input=[user("never mind")])))
    assert err.param == "input.0" and err.message.startswith("No tool output found for function call c1")
    # A call the history itself left behind a later user message is abandoned there, not refused for ever.
    past = history + R.input_items(create(input=[user("never mind")]))
    RC.check_tool_outputs(past, R.input_items(create(input=[user("and now?")])))
