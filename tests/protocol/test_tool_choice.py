"""tool_choice shapes that parse (a dict) but do not name a function: a 400 naming tool_choice, not a 500."""

from __future__ import annotations

import pytest

from rayllm.protocol.errors import APIError
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.tools import plan_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def plan(tool_choice: object):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "tools": TOOLS, "tool_choice": tool_choice})
    return plan_tools(req, other_constraint=False)


@pytest.mark.parametrize("function", ["f", ["f"], 3, None])
def test_a_function_that_is_not_an_object_is_a_400(function):
    with pytest.raises(APIError) as info:
        plan({"type": "function", "function": function})
    assert (info.value.status_code, info.value.param) == (400, "tool_choice")


def test_a_named_function_is_planned():
    assert (plan({"type": "function", "function": {"name": "f"}}).mode, plan("auto").mode) == ("named", "auto")
