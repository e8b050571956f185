"""Stored responses on SQLite (a file) and on a real PostgreSQL server, beside the conversations."""

from __future__ import annotations

import json

import pytest

from rayllm.protocol import conversations as C
from rayllm.protocol import responses_api as R
from rayllm.protocol.errors import APIError
from rayllm.serve.stores.conversation_store import ConversationStore
from rayllm.serve.stores.response_store import ResponseStore

ALICE, BOB = "a" * 64, "b" * 64


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request, tmp_path) -> tuple[ConversationStore, ResponseStore]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/state/conv.db"
    else:
        url = request.getfixturevalue("postgres_url")
        with __import__("psycopg").connect(url, autocommit=True) as conn:  # each test gets an empty schema
            conn.execute("DROP TABLE IF EXISTS conversations, conversation_items, completions, responses, response_items")
    conv = ConversationStore(url)
    return conv, ResponseStore(conv)


def body(rid: str, text: str, call: bool = False) -> dict:
    """A Response as the route stores it: its output items carry the ids the assembler gave them."""
    out = [{"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]
    if call:
        out.append({"id": f"fc_{rid}", "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "f", "arguments": "{}"})
    return {"id": rid, "object": "response", "created_at": 1, "status": "completed", "output": out}


def item(i: int) -> dict:
    return {"id": f"msg_{i}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": str(i)}]}


def test_save_get_context_delete(stores):
    _, store = stores
    store.save(ALICE, body("resp_1", "hello"), [], [item(0)])
    assert store.get(ALICE, "resp_1") == body("resp_1", "hello")
    out = body("resp_1", "hello")["output"]
    # its chain, and the characters the next link's row would keep of it: the stored input's, then the output's
    assert store.context(ALICE, "resp_1") == ([item(0)] + out, len(json.dumps([item(0)])) + len(json.dumps(out[0])))
    assert store.get(BOB, "resp_1") is None and store.context(BOB, "resp_1") is None  # another owner: missing
    assert store.delete(BOB, "resp_1") is False and store.get(ALICE, "resp_1") is not None
    assert store.delete(ALICE, "resp_1") is True
    assert store.get(ALICE, "resp_1") is None and store.delete(ALICE, "resp_1") is False


def test_input_items_pages(stores):
    _, store = stores
    store.save(ALICE, body("resp_1", "x"), [item(i) for i in range(3)], [item(3), item(4)])  # history, then input
    page, more = store.input_items(ALICE, "resp_1", limit=2)
    assert [it["id"] for it in page] == ["msg_4", "msg_3"] and more
    page, more = store.input_items(ALICE, "resp_1", limit=2, order="asc", after="msg_1")
    assert [it["id"] for it in page] == ["msg_2", "msg_3"] and more
    page, more = store.input_items(ALICE, "resp_1", limit=10, order="asc", after="msg_3")
    assert [it["id"] for it in page] == ["msg_4"] and not more
    assert store.input_items(BOB, "resp_1") is None


def test_turn_joins_the_conversation_in_the_same_transaction(stores):
    conv_store, store = stores
    cid = conv_store.create(ALICE)["id"]
    store.save(ALICE, body("resp_1", "hello"), [], [C.message_item("user", "hi")], cid, store=False)
    assert [(i["role"], i["content"][0]["text"]) for i in conv_store.history(ALICE, cid)] == [
        ("user", "hi"), ("assistant", "hello")]  # store: false still keeps the conversation's turn
    assert store.get(ALICE, "resp_1") is None
    with pytest.raises(KeyError):  # another owner's (or a deleted) conversation: nothing is written
        store.save(BOB, body("resp_2", "x"), [], [C.message_item("user", "hi")], cid)
    assert store.get(BOB, "resp_2") is None and len(conv_store.history(ALICE, cid)) == 2


def test_a_turns_items_keep_their_ids_in_the_conversation(stores):
    """The ids a client reads in response.output and /input_items are those of the conversation's items,
    and a call is an fc_ item there (not a fresh id, nor an rs_ one)."""
    conv_store, store = stores
    cid = conv_store.create(ALICE)["id"]
    items = R.input_items(R.ResponseCreate.model_validate({"input": [
        {"role": "user", "content": "Weather?", "id": "msg_clients_own"},
        {"type": "function_call_output", "call_id": "call_0", "output": "18C"}]}))
    resp = body("resp_1", "Let me look.", call=True)
    store.save(ALICE, resp, [], items, cid)
    stored = conv_store.history(ALICE, cid)
    assert [i["id"] for i in stored] == [i["id"] for i in items + resp["output"]]
    assert [i["id"].split("_")[0] for i in stored] == ["msg", "fco", "msg", "fc"]
    assert "msg_clients_own" not in {i["id"] for i in stored}  # a client's id never reaches the store
    assert [i["id"] for i in store.input_items(ALICE, "resp_1", order="asc")[0]] == [i["id"] for i in items]


def test_find_items_by_id_for_their_owner_only(stores):
    """What an item_reference may name: an item of the owner's conversations, or of a stored response's
    own input or output; another owner's reads as missing, and a deleted response's items are gone."""
    conv_store, store = stores
    conv = conv_store.create(ALICE, None, [C.message_item("user", "in a conversation")])
    conv_item = conv_store.history(ALICE, conv["id"])[0]
    store.save(ALICE, body("resp_1", "answer"), [conv_item], [item(1)])  # its chain's item is not its own
    store.save(ALICE, body("resp_2", "not stored"), [], [item(2)], store=False)
    wanted = [conv_item["id"], "msg_1", "msg_resp_1", "msg_2", "msg_resp_2", "msg_nope"]
    assert store.find_items(ALICE, wanted) == {conv_item["id"]: conv_item, "msg_1": item(1),
                                               "msg_resp_1": body("resp_1", "answer")["output"][0]}
    assert store.find_items(BOB, wanted) == {}
    store.delete(ALICE, "resp_1")
    assert store.find_items(ALICE, wanted) == {conv_item["id"]: conv_item}


def test_a_turn_that_might_not_fit_is_refused_before_it_runs(stores, monkeypatch):
    """Room is reserved for every output item a response may make: a tool-calling turn (a thought, a
    message and a call: 4 items with its input) into a conversation with room for 3 is refused up front,
    where reserving input + 1 let it generate and then fail to be stored."""
    monkeypatch.setattr(C, "MAX_CONVERSATION_ITEMS", 6)
    conv_store, store = stores
    cid = conv_store.create(ALICE, None, [C.message_item("user", f"m{i}") for i in range(3)])["id"]
    tools = R.ResponseCreate.model_validate({"input": "q", "tools": [{"type": "function", "name": "f"}]})
    turn_in = R.input_items(tools)
    with pytest.raises(APIError) as err:
        conv_store.history(ALICE, cid, room_for=len(turn_in) + R.turn_output_items(tools))
    assert err.value.code == "conversation_full"
    made = body("resp_1", "Let me look.", call=True)
    made["output"].insert(0, C.reasoning_item("thinking") | {"id": "rs_resp_1"})
    with pytest.raises(APIError):  # what reserving len(input) + 1 let through: refused only once generated
        store.save(ALICE, made, [], turn_in, cid)
    plain = R.ResponseCreate.model_validate({"input": "q"})  # no tool: a thought and a message at most
    assert R.turn_output_items(plain) == 2
    conv_store.history(ALICE, cid, room_for=len(R.input_items(plain)) + R.turn_output_items(plain))
    store.save(ALICE, body("resp_2", "ok") | {"output": made["output"][:2]}, [], R.input_items(plain), cid)
    assert len(conv_store.history(ALICE, cid)) == 6
