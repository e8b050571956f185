"""The context a Responses request builds on (its previous_response_id chain or its conversation, then its
input), checked as OpenAI checks it before anything is generated: each item appears once, every tool output
answers a call made before it, no call is left unanswered when the user speaks again, and the whole fits
MAX_CONTEXT_CHARS (a conversation's own bound is rayllm.protocol.conversations.check_room).

Pure protocol (no storage, no Ray): rayllm.serve.routes.responses_routes loads the context and calls these.
"""

from __future__ import annotations

import json
from typing import Any

from rayllm.protocol import responses_api as R
from rayllm.protocol.errors import bad_request
from rayllm.protocol.limits import MAX_CONTEXT_CHARS, turn_output_chars


def item_chars(items: list[dict[str, Any]]) -> int:
    """Characters of the items as they are stored (each one's JSON)."""
    return sum(len(json.dumps(it)) for it in items)


def check_chain(response_id: str, chars: int) -> None:
    """A 400 naming previous_response_id when the chain continued with this input holds more than
    MAX_CONTEXT_CHARS characters (each stored response keeps its whole chain: unbounded, storage would grow
    with the square of the chain's length)."""
    if chars > MAX_CONTEXT_CHARS:
        raise bad_request(f"the chain of previous_response_id '{response_id}' with this input would hold {chars} "
                          f"characters; at most {MAX_CONTEXT_CHARS} are allowed: start a new chain, or send the "
                          "context you need as input", param="previous_response_id", code="context_too_large")


def turn_room(req: R.ResponseCreate, items: list[dict[str, Any]]) -> tuple[int, int]:
    """The items and characters a turn stored into a conversation needs: its input and the most its output
    may take (rayllm.protocol.limits.turn_output_chars), reserved before it runs."""
    out_items = R.turn_output_items(req)
    top = (req.top_logprobs or 0) if R.wants_logprobs(req) else None
    return len(items) + out_items, item_chars(items) + turn_output_chars(out_items, req.max_output_tokens, top)


def check_unique(raw_input: str | list[dict[str, Any]], history: list[dict[str, Any]]) -> None:
    """OpenAI's 400 for an input item (sent whole or as an item_reference) whose id is already in the context:
    an item of the loaded chain or conversation, or one earlier in this input."""
    if isinstance(raw_input, str):
        return
    seen = {it.get("id") for it in history}
    for i, it in enumerate(raw_input):
        item_id = it.get("id") if isinstance(it, dict) else None
        if not isinstance(item_id, str) or not item_id:
            continue
        if item_id in seen:
            raise bad_request(f"Duplicate item found with id {item_id}.", param=f"input.{i}.id",
                              code="duplicate_item")
        seen.add(item_id)


def check_tool_outputs(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """OpenAI's 400s for tool results that do not match calls: a function_call_output whose call_id no earlier
    function_call (of the context or this input) made, and a user message in this input while a call is still
    unanswered. The history is not judged (a client may have added anything to a conversation): a call left
    unanswered there before a later user message counts as abandoned."""
    calls: dict[str, bool] = {}  # call_id -> answered, in order
    for it in history:
        _track(calls, it)
    for i, it in enumerate(items):
        kind = it.get("type")
        if kind == "function_call_output" and it["call_id"] not in calls:
            raise bad_request(f"No tool call found for function call output with call_id {it['call_id']}.",
                              param=f"input.{i}.call_id", code="tool_call_not_found")
        if kind == "message" and it.get("role") == "user" and (open_calls := [c for c, ok in calls.items() if not ok]):
            raise bad_request(f"No tool output found for function call {open_calls[0]}: send a "
                              "function_call_output for it before the next user message", param=f"input.{i}",
                              code="tool_output_missing")
        _track(calls, it)


def _track(calls: dict[str, bool], item: dict[str, Any]) -> None:
    kind = item.get("type")
    if kind in ("function_call", "function_call_output"):
        calls[str(item.get("call_id"))] = kind == "function_call_output"
    elif kind == "message" and item.get("role") == "user":  # earlier calls are past: answered or abandoned
        calls.update(dict.fromkeys(calls, True))
