"""Stored responses on SQLite (a file) and on a real PostgreSQL server, beside the conversations."""

from __future__ import annotations

import pytest

from rayllm.protocol import conversations as C
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
            conn.execute("DROP TABLE IF EXISTS conversations, conversation_items, completions, responses")
    conv = ConversationStore(url)
    return conv, ResponseStore(conv)


def body(rid: str, text: str) -> dict:
    return {"id": rid, "object": "response", "created_at": 1, "status": "completed",
            "output": [{"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]}


def item(i: int) -> dict:
    return {"id": f"msg_{i}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": str(i)}]}


def test_save_get_context_delete(stores):
    _, store = stores
    store.save(ALICE, body("resp_1", "hello"), [item(0)])
    assert store.get(ALICE, "resp_1") == body("resp_1", "hello")
    assert store.context(ALICE, "resp_1") == [item(0)] + body("resp_1", "hello")["output"]
    assert store.get(BOB, "resp_1") is None and store.context(BOB, "resp_1") is None  # another owner: missing
    assert store.delete(BOB, "resp_1") is False and store.get(ALICE, "resp_1") is not None
    assert store.delete(ALICE, "resp_1") is True
    assert store.get(ALICE, "resp_1") is None and store.delete(ALICE, "resp_1") is False


def test_input_items_pages(stores):
    _, store = stores
    store.save(ALICE, body("resp_1", "x"), [item(i) for i in range(5)])
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
    turn = [C.message_item("user", "hi"), C.message_item("assistant", "hello")]
    store.save(ALICE, None, [], cid, turn)  # store: false still keeps the conversation's turn
    assert [(i["role"], i["content"][0]["text"]) for i in conv_store.history(ALICE, cid)] == [
        ("user", "hi"), ("assistant", "hello")]
    with pytest.raises(KeyError):  # another owner's (or a deleted) conversation: nothing is written
        store.save(BOB, body("resp_2", "x"), [], cid, turn)
    assert store.get(BOB, "resp_2") is None and len(conv_store.history(ALICE, cid)) == 2
