"""The Responses routes (rayllm/serve/routes/responses_routes.py): a conversation turn's output is held to the
room reserved for it (real output parsing: the chat path's parser, parallel tool calls); the checks a request
passes before the model runs, through the real routes on real SQLite and PostgreSQL stores."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from rayllm.protocol import conversations as C
from rayllm.protocol import protocol as P
from rayllm.protocol import responses_api as R
from rayllm.protocol import responses_context as RC
from rayllm.protocol.chat_output import ChatOutputParser
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.responses_events import skeleton
from rayllm.protocol.tools import plan_tools
from rayllm.serve.routes.conversation_routes import ConversationRoutes, chat_turn_room
from rayllm.serve.routes.http_app import app
from rayllm.serve.routes.responses_routes import ResponsesFormat, ResponsesRoutes
from rayllm.serve.stores.conversation_store import ConversationStore
from tests.serve.stores.store_urls import fresh_url

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


# ---- the routes themselves, on a real store (SQLite and PostgreSQL), up to the model ---------------------------

OWNER = "o" * 64


class Reached(Exception):
    """The request got past every check to the ingress's prepare_chat (render, then the model)."""


class Routes(ResponsesRoutes, ConversationRoutes):
    """The ingress's /v1/responses and /v1/conversations routes on a real store. The tests here stop where the
    ingress would render and generate: prepare_chat records the chat messages it was given and raises Reached."""

    model_name = "m"

    def __init__(self, url: str) -> None:
        self.store = ConversationStore(url)
        self.prompts: list[list[dict]] = []

    def check_auth(self, request: Request) -> str:
        return OWNER

    async def prepare_chat(self, request, owner, req, messages, rid, param="messages"):
        self.prompts.append(messages)
        raise Reached


@pytest.fixture(params=["sqlite", "postgresql"])
def routes(request, tmp_path) -> Routes:
    url = fresh_url(request, tmp_path, "conversations, conversation_items, completions, responses, response_items")
    return Routes(url)


def http(body: dict | None = None, method: str = "POST", query: bytes = b"") -> Request:
    raw = json.dumps(body).encode() if body is not None else b""
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.request", "body": b"", "more_body": False}

    headers = [(b"content-type", b"application/json")] if body is not None else []  # as the OpenAI SDK sends
    return Request({"type": "http", "method": method, "path": "/", "headers": headers, "query_string": query,
                    "app": app}, receive)


async def respond(routes: Routes, body: dict) -> APIError | None:
    """The route's refusal, or None when the request reached the model."""
    try:
        await routes.create_response(http(body))
    except Reached:
        return None
    except APIError as err:
        return err
    raise AssertionError("the route answered without generating")


def stored(rid: str, output: list[dict]) -> dict:
    """A Response as the route stores it (its output items carry the assembler's ids)."""
    return {"id": rid, "object": "response", "created_at": 1, "status": "completed", "output": output}


async def test_a_chain_past_its_character_bound_is_refused_before_its_row_is_read(routes, monkeypatch):
    """Each stored response keeps its whole chain: the chain is bounded like a conversation, and the bound is
    checked on the row's stored length (SQL) before it is parsed, naming previous_response_id."""
    monkeypatch.setattr(RC, "MAX_CONTEXT_CHARS", 3000)
    first = R.input_items(R.ResponseCreate.model_validate({"input": "x" * 1500}))
    answer = R.message_item("assistant", "ok", "msg_a1")
    routes.response_store().save(OWNER, stored("resp_1", [answer]), [], first)
    assert await respond(routes, {"input": "short", "previous_response_id": "resp_1"}) is None
    assert [m["content"] for m in routes.prompts[-1]] == ["x" * 1500, "ok", "short"]
    err = await respond(routes, {"input": "y" * 1500, "previous_response_id": "resp_1"})
    assert (err.status_code, err.param, err.code) == (400, "previous_response_id", "context_too_large")
    with routes.store._tx() as cur:  # a row over the bound on its own is refused unread: not even parsed
        cur.execute("UPDATE responses SET input_items = ? WHERE id = ?", ("[" + "z" * 4000, "resp_1"))
    err = await respond(routes, {"input": "short", "previous_response_id": "resp_1"})
    assert (err.status_code, err.param) == (400, "previous_response_id") and len(routes.prompts) == 1


async def test_a_conversation_without_room_for_the_turn_is_refused_before_the_model_runs(routes, monkeypatch):
    """Room for the turn's input and an allowance for its output (max_output_tokens' worth, 1 MiB without
    one), in characters as well as items, is checked before generating: a full conversation is a 400 up
    front, not a lost answer after it was generated."""
    monkeypatch.setattr(C, "MAX_CONVERSATION_CHARS", 6000)
    cid = routes.store.create(OWNER, None, [R.message_item("user", "h" * 4400)])["id"]
    room = 6000 - RC.item_chars(routes.store.history(OWNER, cid))
    assert await respond(routes, {"input": "hi", "conversation": cid, "max_output_tokens": 10}) is None
    for body in ({"max_output_tokens": 40}, {}):  # its output may not fit / has no bound: the 1 MiB allowance
        err = await respond(routes, {"input": "hi", "conversation": cid} | body)
        assert (err.status_code, err.param, err.code) == (400, "conversation", "conversation_full")
    other = routes.store.create(OWNER, None, [R.message_item("user", "r" * (room - 200))])["id"]
    ref = routes.store.history(OWNER, other)[0]["id"]
    err = await respond(routes, {"input": [{"type": "item_reference", "id": ref}], "conversation": cid,
                                 "max_output_tokens": 1})  # what the reference brings counts too
    assert err.code == "conversation_full" and len(routes.prompts) == 1
    # The chat path's turn (/v1/chat/completions with conversation and store): the same check, before it runs.
    chat = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                  "conversation": cid, "store": True, "max_tokens": 10})
    await routes.conversation_history(OWNER, cid, *chat_turn_room(chat, {"role": "user", "content": "hi"}))
    for change in ({"max_tokens": 40}, {"max_tokens": None}):
        with pytest.raises(APIError) as exc:
            big = chat.model_copy(update=change)
            await routes.conversation_history(OWNER, cid, *chat_turn_room(big, {"role": "user", "content": "hi"}))
        assert exc.value.code == "conversation_full"
    assert chat_turn_room(chat.model_copy(update={"store": False, "max_tokens": None}), {}) == (0, 0)


async def test_tool_outputs_must_match_calls_and_no_item_comes_twice(routes):
    """OpenAI's 400s, before anything runs: an output for a call never made, a new user message while a call
    waits for its output, and an item of the chain sent again (whole, or as an item_reference)."""
    call = {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f",
            "arguments": "{}"}
    routes.response_store().save(OWNER, stored("resp_1", [call]), [], R.input_items(
        R.ResponseCreate.model_validate({"input": "weather?"})))
    chained = {"previous_response_id": "resp_1", "tools": TOOLS}
    for item, param, code in (
            ({"role": "user", "content": "never mind"}, "input.0", "tool_output_missing"),
            ({"type": "function_call_output", "call_id": "call_nope", "output": "x"}, "input.0.call_id",
             "tool_call_not_found"),
            ({"type": "item_reference", "id": "fc_1"}, "input.0.id", "duplicate_item"),
            (call, "input.0.id", "duplicate_item")):
        err = await respond(routes, chained | {"input": [item]})
        assert (err.status_code, err.param, err.code) == (400, param, code)
    assert not routes.prompts
    err = await respond(routes, {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]})
    assert err.param == "input.0.call_id"  # no chain: no call to answer
    assert await respond(routes, chained | {"input": [{"type": "function_call_output", "call_id": "call_1",
                                                       "output": "18C"}]}) is None
    assert routes.prompts[-1][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "18C"}


async def test_ids_with_a_nul_are_unknown_ids(routes):
    """PostgreSQL's text cannot hold NUL (psycopg raises DataError, a 500, on one in a parameter): an id with
    one names nothing, on either database, and is answered as any unknown id is."""
    cid = routes.store.create(OWNER, None, [R.message_item("user", "hi")])["id"]
    routes.response_store().save(OWNER, stored("resp_1", [R.message_item("assistant", "a", "msg_a")]), [], [])
    bad, get = "x_\x00", http(method="GET")
    for call, code in ((lambda: routes.get_conversation(bad, get), "conversation_not_found"),
                       (lambda: routes.delete_conversation(bad, get), "conversation_not_found"),
                       (lambda: routes.get_item(cid, bad, get), "item_not_found"),
                       (lambda: routes.delete_item(cid, bad, get), "item_not_found"),
                       (lambda: routes.get_stored_completion(bad, get), "completion_not_found"),
                       (lambda: routes.get_response(bad, get), "response_not_found"),
                       (lambda: routes.delete_response(bad, get), "response_not_found"),
                       (lambda: routes.list_input_items(bad, get), "response_not_found")):
        with pytest.raises(APIError) as exc:
            await call()
        assert (exc.value.status_code, exc.value.code) == (404, code)
    page = await routes.list_items(cid, http(method="GET", query=b"after=msg_%00"))
    assert json.loads(page.body)["data"] == []  # as any unknown cursor
    for body, status, param in (({"previous_response_id": bad}, 404, "previous_response_id"),
                                ({"conversation": bad}, 404, "conversation"),
                                ({"input": [{"type": "item_reference", "id": bad}]}, 400, "input.0.id")):
        err = await respond(routes, {"input": "hi"} | body)
        assert (err.status_code, err.param) == (status, param)
