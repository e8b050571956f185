"""The conversation store on SQLite (a file, WAL) and on a real PostgreSQL server; API keys; item conversion."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import sqlite3
import subprocess
import sys

import pytest

from rayllm.protocol import conversations as C
from rayllm.protocol import responses_api as R
from rayllm.protocol.errors import APIError
from rayllm.serve.auth import KeyRing
from rayllm.serve.config import ServerConfig
from rayllm.serve.routes.conversation_routes import client_items
from rayllm.serve.stores.conversation_store import ConversationStore
from tests.serve.stores.store_urls import fresh_url

ALICE, BOB = "a" * 64, "b" * 64


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    return fresh_url(request, tmp_path, "conversations, conversation_items, completions")


def turn(q: str, a: str, reasoning: str | None = None) -> list[dict]:
    return C.turn_items({"role": "user", "content": q}, a, reasoning)


def completion(cid: str, text: str) -> dict:
    return {"id": cid, "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


def test_create_get_update_delete_and_isolation(url):
    store = ConversationStore(url)
    conv = store.create(ALICE, {"topic": "x"}, client_items([{"role": "user", "content": "hi"}]))
    assert conv["id"].startswith("conv_") and conv["object"] == "conversation" and conv["metadata"] == {"topic": "x"}
    assert store.get(ALICE, conv["id"]) == conv
    # Bob sees nothing of Alice's: every read and write answers as for a missing conversation.
    assert store.get(BOB, conv["id"]) is None
    assert store.items(BOB, conv["id"]) is None and store.history(BOB, conv["id"]) is None
    assert store.update(BOB, conv["id"], {"k": "v"}) is None
    assert store.add_items(BOB, conv["id"], turn("q", "a")) is None
    assert store.delete(BOB, conv["id"]) is False
    with pytest.raises(KeyError):
        store.save_completion(BOB, completion("chatcmpl-b", "x"), None, conv["id"], turn("q", "a"))
    assert store.get_completion(BOB, "chatcmpl-b") is None
    assert [i["content"][0]["text"] for i in store.history(ALICE, conv["id"])] == ["hi"]

    assert store.update(ALICE, conv["id"], {"k": "v"})["metadata"] == {"k": "v"}
    assert store.delete(ALICE, conv["id"]) is True
    assert store.get(ALICE, conv["id"]) is None and store.delete(ALICE, conv["id"]) is False
    assert store.get("", "conv_missing") is None


def test_items_paging_and_order(url):
    store = ConversationStore(url)
    cid = store.create(ALICE)["id"]
    for i in range(5):
        store.add_items(ALICE, cid, [C.message_item("user", f"m{i}")])
    texts = lambda items: [i["content"][0]["text"] for i in items]  # noqa: E731
    page, more = store.items(ALICE, cid, limit=2, order="asc")
    assert texts(page) == ["m0", "m1"] and more
    page, more = store.items(ALICE, cid, limit=10, order="asc", after=page[-1]["id"])
    assert texts(page) == ["m2", "m3", "m4"] and not more
    page, more = store.items(ALICE, cid, limit=3)  # newest first by default, as OpenAI
    assert texts(page) == ["m4", "m3", "m2"] and more
    assert len({i["id"] for i in store.history(ALICE, cid)}) == 5


def test_items_keep_the_servers_ids_and_others_get_one_by_type(url):
    """A Response's items (ids made by responses_api) keep their ids in the conversation; items without one
    (a chat turn's) get one with their type's prefix."""
    store = ConversationStore(url)
    cid = store.create(ALICE)["id"]
    made = R.input_items(R.ResponseCreate.model_validate({"input": [
        {"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"}]}))
    assert [i["id"] for i in store.add_items(ALICE, cid, made)] == [i["id"] for i in made]
    bare = [{k: v for k, v in it.items() if k != "id"} for it in made] + [C.reasoning_item("hm")]
    added = store.add_items(ALICE, cid, bare)
    assert [i["id"].rsplit("_", 1)[0] for i in added] == ["msg", "fc", "fco", "rs"]
    assert [i["id"] for i in store.history(ALICE, cid)] == [i["id"] for i in made + added]


def test_one_item_is_read_and_deleted_by_id(url):
    store = ConversationStore(url)
    conv = store.create(ALICE, None, [C.message_item("user", "a"), C.message_item("user", "b")])
    first, second = store.history(ALICE, conv["id"])
    assert store.item(ALICE, conv["id"], second["id"]) == (conv, second)
    assert store.item(ALICE, conv["id"], "msg_nope") == (conv, None)
    other = store.create(ALICE)["id"]
    assert store.item(ALICE, other, first["id"]) == (store.get(ALICE, other), None)  # another conversation's
    assert store.item(BOB, conv["id"], first["id"]) == (None, None)  # another owner's: as a missing one
    assert store.delete_item(BOB, conv["id"], first["id"]) == (None, False)
    assert store.delete_item(ALICE, other, first["id"]) == (store.get(ALICE, other), False)
    assert store.delete_item(ALICE, conv["id"], first["id"]) == (conv, True)
    assert store.history(ALICE, conv["id"]) == [second]
    assert store.delete_item(ALICE, conv["id"], first["id"]) == (conv, False)


def test_a_conversation_is_bounded_at_write_and_a_full_one_refuses_a_stored_turn(url, monkeypatch):
    monkeypatch.setattr(C, "MAX_CONVERSATION_ITEMS", 5)
    monkeypatch.setattr(C, "MAX_CONVERSATION_CHARS", 4000)
    store = ConversationStore(url)
    cid = store.create(ALICE, None, [C.message_item("user", "m0")])["id"]
    store.add_items(ALICE, cid, [C.message_item("user", f"m{i}") for i in (1, 2, 3)])
    with pytest.raises(APIError) as err:  # 4 + 2 > 5: the whole batch is refused, nothing of it stored
        store.add_items(ALICE, cid, [C.message_item("user", "m4"), C.message_item("user", "m5")])
    assert (err.value.status_code, err.value.code, err.value.param) == (400, "conversation_full", "conversation")
    assert len(store.history(ALICE, cid)) == 4
    with pytest.raises(APIError):  # a turn (up to 3 items) no longer fits: refused before it is generated
        store.history(ALICE, cid, room_for=3)
    assert len(store.history(ALICE, cid, room_for=1)) == 4
    with pytest.raises(APIError):  # a chat turn saved into it past the bound
        store.save_completion(ALICE, completion("chatcmpl-x", "a"), None, cid, turn("q", "a"))
    assert store.get_completion(ALICE, "chatcmpl-x") is None  # one transaction: neither is kept
    other = store.create(ALICE)["id"]
    with pytest.raises(APIError):  # the size bound: one item of 5,000 characters
        store.add_items(ALICE, other, [C.message_item("user", "x" * 5000)])
    assert store.history(ALICE, other) == []


def test_turn_is_one_transaction_and_completion_keeps_metadata(url):
    store = ConversationStore(url)
    cid = store.create(ALICE)["id"]
    store.save_completion(ALICE, completion("chatcmpl-1", "Paris"), {"run": "1"}, cid,
                          turn("Capital?", "Paris", reasoning="France's capital..."))
    items = store.history(ALICE, cid)
    assert [i["type"] for i in items] == ["message", "reasoning", "message"]
    assert items[0]["role"] == "user" and items[2]["content"][0] == {
        "type": "output_text", "text": "Paris", "annotations": [], "logprobs": []}
    assert C.history_messages(items) == [{"role": "user", "content": "Capital?"},
                                         {"role": "assistant", "content": "Paris"}]
    got = store.get_completion(ALICE, "chatcmpl-1")
    assert got["metadata"] == {"run": "1"} and got["choices"][0]["message"]["content"] == "Paris"
    assert store.get_completion(BOB, "chatcmpl-1") is None

    # A write that fails half-way (the second item cannot be serialised) leaves nothing behind.
    bad = turn("q2", "a2") + [{"type": "message", "content": object()}]
    with pytest.raises(TypeError):
        store.save_completion(ALICE, completion("chatcmpl-2", "a2"), None, cid, bad)
    assert len(store.history(ALICE, cid)) == 3 and store.get_completion(ALICE, "chatcmpl-2") is None


def test_sqlite_is_wal_and_survives_a_killed_writer(tmp_path):
    url = f"sqlite:///{tmp_path}/conv.db"
    ConversationStore(url)
    assert sqlite3.connect(tmp_path / "conv.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # A process that stores, then dies without any clean-up: what it was told is stored, is.
    code = ("import os; from rayllm.serve.stores.conversation_store import ConversationStore as S; "
            f"s = S({url!r}); c = s.create('o'); print(c['id'], flush=True); os._exit(9)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 9
    assert ConversationStore(url).get("o", out.stdout.strip()) is not None


def _writer(url: str, owner: str, n: int) -> None:
    store = ConversationStore(url)
    for i in range(n):
        cid = store.create(owner)["id"]
        store.save_completion(owner, completion(f"chatcmpl-{owner}-{i}", "x"), None, cid, turn("q", "a"))


def test_sqlite_several_processes_share_one_file(tmp_path):
    """Several ingress replicas on one node: concurrent writers to one WAL file lose nothing."""
    url = f"sqlite:///{tmp_path}/conv.db"
    ConversationStore(url)
    procs = [mp.get_context("spawn").Process(target=_writer, args=(url, f"o{k}", 15)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = ConversationStore(url)
    assert all(store.get_completion(f"o{k}", f"chatcmpl-o{k}-{i}") for k in range(3) for i in range(15))


def test_storage_url_must_be_sqlite_or_postgresql():
    with pytest.raises(ValueError, match="sqlite:///"):
        ConversationStore("mysql://x")


# ---- API keys -------------------------------------------------------------------------------------


def test_keyring_off_plain_and_hashed_keys():
    assert KeyRing.from_entries(()).owner(None) == ""  # auth off: everyone is the local owner
    digest = hashlib.sha256(b"secret-2").hexdigest()
    ring = KeyRing.from_entries(["secret-1", f"sha256:{digest.upper()}"])
    assert ring.owner("Bearer secret-2") == digest  # the hashed entry's owner id is the key's digest
    assert ring.owner("bearer secret-1") == hashlib.sha256(b"secret-1").hexdigest()
    for header in (None, "", "Bearer", "Bearer ", "Bearer secret-3", "Basic secret-1", f"Bearer sha256:{digest}"):
        with pytest.raises(APIError) as e:
            ring.owner(header)
        assert e.value.status_code == 401 and e.value.type == "authentication_error"
        assert e.value.code == "invalid_api_key"


def test_malformed_hashed_key_fails_at_start_up(monkeypatch):
    with pytest.raises(ValueError, match="sha256:<64 hex digits>"):
        ServerConfig(api_keys=("sha256:abc",))
    monkeypatch.setenv("API_KEYS", "k1, sha256:" + "0" * 64)
    monkeypatch.setenv("STORAGE_URL", "postgresql://db/x")
    cfg = ServerConfig.from_args({"api_keys": ["k0"]})
    assert cfg.api_keys == ("k0", "k1", "sha256:" + "0" * 64) and cfg.storage_url == "postgresql://db/x"
    monkeypatch.delenv("STORAGE_URL")
    assert ServerConfig.from_args({}).storage_url.endswith("/rayllm-tp/conversations.db")


# ---- protocol: conversation ids, items, history ---------------------------------------------------


def test_conversation_param_and_history_placement():
    assert C.conversation_id("conv_1") == C.conversation_id({"id": "conv_1"}) == "conv_1"
    assert C.conversation_id(None) is None
    for bad in ({}, {"id": 3}, ""):
        with pytest.raises(APIError) as e:
            C.conversation_id(bad)
        assert e.value.param == "conversation"
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q2"}]
    assert [m["content"] for m in C.with_history(history, msgs)] == ["s", "q1", "a1", "q2"]


def test_client_items_are_any_input_item_checked_with_our_ids():
    """POST /v1/conversations(/items) takes what the Responses input takes, by its rules; a client's id is
    replaced (it could name another owner's item)."""
    items = client_items([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}], "id": "msg_mine"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_mine"},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}])
    assert [i["id"].rsplit("_", 1)[0] for i in items] == ["msg", "fc", "fco", "rs"]
    assert not {"msg_mine", "fc_mine"} & {i["id"] for i in items}
    assert items[0] | {"id": None} == {"id": None, "type": "message", "role": "user", "status": "completed",
                                       "content": [{"type": "input_text", "text": "hi"}]}
    for bad, param in (({"role": "robot", "content": "x"}, "items.0.role"),
                       ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
                        "items.0.content.0.type"),
                       ({"type": "function_call", "call_id": "", "name": "f"}, "items.0.call_id"),
                       ({"type": "item_reference", "id": "msg_1"}, "items.0"),
                       ({"type": "web_search_call", "id": "ws_1"}, "items.0.type")):
        with pytest.raises(APIError) as e:
            client_items([bad])
        assert e.value.status_code == 400 and e.value.param == param


def test_locked_sqlite_answers_503_within_the_timeout_and_recovers(tmp_path):
    """Another connection holds the write lock: writes give up after the busy timeout with a 503
    storage_unavailable (not a 30 s wait and a 500); reads go on (WAL); the lock's release heals it."""
    import time

    from rayllm.serve.stores.conversation_store import StorageUnavailable

    url = f"sqlite:///{tmp_path}/conv.db"
    store = ConversationStore(url, timeout_s=0.5)
    cid = store.create(ALICE)["id"]
    holder = sqlite3.connect(tmp_path / "conv.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for write in (lambda: store.create(ALICE), lambda: store.save_completion(ALICE, completion("c1", "x"), None)):
            t0 = time.monotonic()
            with pytest.raises(StorageUnavailable) as err:
                write()
            assert time.monotonic() - t0 < 5
            assert err.value.status_code == 503 and err.value.to_dict()["error"]["code"] == "storage_unavailable"
        assert store.get(ALICE, cid) is not None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.save_completion(ALICE, completion("c1", "x"), None)
    assert store.get_completion(ALICE, "c1")["choices"][0]["message"]["content"] == "x"


def test_stopped_postgresql_answers_503_within_the_timeout(postgres_url):
    """A pooled PostgreSQL store whose server goes away: each call fails within its timeout with a 503,
    instead of hanging on a dead connection or a connect without a timeout."""
    import os
    import time
    from urllib.parse import parse_qs, urlparse

    from pg_server import _as_user, find_bin_dir, postgres_server

    from rayllm.serve.stores.conversation_store import StorageUnavailable

    with postgres_server() as url:  # a server of its own, to stop (the session's keeps serving others)
        store = ConversationStore(url, timeout_s=1.0, pool_size=2)
        try:
            cid = store.create(ALICE)["id"]
            assert store.get(ALICE, cid) is not None
            host = parse_qs(urlparse(url).query)["host"][0]
            subprocess.run([*_as_user(), os.path.join(find_bin_dir(), "pg_ctl"), "-D", os.path.join(host, "data"),
                            "-m", "immediate", "-w", "stop"], check=True, capture_output=True)
            for call in (lambda: store.create(ALICE), lambda: store.get(ALICE, cid),
                         lambda: store.save_completion(ALICE, completion("c1", "x"), None)):
                t0 = time.monotonic()
                with pytest.raises(StorageUnavailable):
                    call()
                assert time.monotonic() - t0 < 10
        finally:
            store.close()
