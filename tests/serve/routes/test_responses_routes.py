"""The Responses route's wire format (rayllm/serve/routes/responses_routes.py): a conversation turn's output
is held to the room reserved for it. Real output parsing (the chat path's parser, parallel tool calls)."""

from __future__ import annotations

import json

import pytest

from rayllm.protocol import responses_api as R
from rayllm.protocol.chat_output import ChatOutputParser
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.responses_events import skeleton
from rayllm.protocol.tools import plan_tools
from rayllm.serve.routes.responses_routes import ResponsesFormat

TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


def feed_calls(calls: int, max_items: int | None) -> dict:
    """A response whose model makes `calls` parallel calls (tool_choice required), fed as a whole body."""
    req = R.ResponseCreate.model_validate({"input": "x", "tools": TOOLS, "tool_choice": "required"})
    chat = R.chat_request(req, [{"role": "user", "content": "x"}])
    parser = ChatOutputParser(tools=plan_tools(chat, other_constraint=False))
    state = GenerationState(1, lambda: parser)
    fmt = ResponsesFormat(state, skeleton(req, "resp_1", "m", "conv_1"), "resp_1", max_items)
    text = json.dumps([{"name": "f", "arguments": {"i": i}} for i in range(calls)])
    d = GenerationDelta(index=0, text=text, token_ids=[1], logprobs=None, finish_reason="stop", matched_stop=None,
                        prompt_tokens=3, cached_tokens=0, completion_tokens=1)
    choice, pieces = state.add(d)
    fmt.feed(choice, d, pieces)
    fmt.finish()
    return fmt.body()


def test_a_conversation_turn_past_its_reserved_output_items_fails():
    cap = R.MAX_TURN_OUTPUT_ITEMS
    assert len(feed_calls(cap, cap)["output"]) == cap  # up to the room reserved: a normal response
    assert len(feed_calls(cap + 4, None)["output"]) == cap + 4  # no conversation: no bound
    with pytest.raises(APIError) as err:
        feed_calls(cap + 4, cap)
    assert (err.value.status_code, err.value.code, err.value.param) == (400, "too_many_output_items",
                                                                       "parallel_tool_calls")
