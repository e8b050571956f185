"""Platform features through Ray Serve, the real model and the openai client: API keys, request ids,
conversations (`store`, `conversation`, `metadata` in extra_body) and tenant isolation."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

Q1 = "My name is Ada. Say hello to me."
Q2 = "What is my name?"


def chat(client, model, content, **extra):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=12, extra_body=extra or None)


def wait_for_log(needle: str, timeout_s: float = 20.0) -> bool:
    """Whether a Serve replica log of this Ray session contains `needle` (logs are flushed per record)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(needle in f.read_text(errors="replace") for f in logs.glob("replica_llm_llm_*.log")):
            return True
        time.sleep(0.5)
    return False


def texts(client, cid, order="asc"):
    return [(i.role, i.content[0].text) for i in client.conversations.items.list(cid, order=order, limit=100).data]


# ---- API keys and request ids ----------------------------------------------------------------------


def test_auth_required_on_v1_routes_health_open(server, auth):
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/conversations"),
                         ("GET", "/v1/conversations/conv_x/items"), ("POST", "/tokenize")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {auth['Authorization'][7:]}"}):
            r = httpx.request(method, f"{server}{path}", headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            body = r.json()
            assert body["error"]["type"] == "authentication_error" and body["error"]["code"] == "invalid_api_key"
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["request_id"] == r.headers["x-request-id"]  # seed 002: request_id beside error


def test_hashed_key_is_accepted(client2, model_name):
    assert [m.id for m in client2.models.list().data] == [model_name]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client2.base_url), api_key="sha256:" + "0" * 64, max_retries=0).models.list()


def test_request_id_echoed_generated_and_in_error_bodies(server, auth, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=auth | {"X-Request-Id": "trace-abc-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc-1"
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=auth)
    generated = r.headers["x-request-id"]
    assert r.status_code == 200 and len(generated) >= 16
    r2 = httpx.post(f"{server}/v1/chat/completions", json=body, headers=auth)
    assert r2.headers["x-request-id"] != generated
    # Error bodies carry the same id: a bad request, an unknown model, an unknown route.
    for method, path, payload in (("POST", "/v1/chat/completions", {"messages": []}),
                                  ("POST", "/v1/chat/completions", body | {"model": "nope"}),
                                  ("GET", "/v1/nothing-here", None)):
        r = httpx.request(method, f"{server}{path}", json=payload, headers=auth | {"X-Request-Id": "trace-err-2"})
        assert r.status_code in (400, 404) and r.headers["x-request-id"] == "trace-err-2"
        assert r.json()["request_id"] == "trace-err-2" and r.json()["error"]["message"]
    # Streams carry it too (the header is sent before the first event).
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body | {"stream": True},
                      headers=auth | {"X-Request-Id": "trace-stream-3"}) as r:
        assert r.headers["x-request-id"] == "trace-stream-3"
        assert [ln for ln in r.iter_lines() if ln][-1] == "data: [DONE]"


# ---- conversations ---------------------------------------------------------------------------------


def test_store_read_continue_and_delete(client, model_name, server, auth):
    conv = client.conversations.create(metadata={"topic": "names"},
                                       items=[{"type": "message", "role": "system", "content": "Be brief."}])
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conv.id).id == conv.id

    # store: true keeps the latest input and the answer; metadata is kept with the stored completion.
    first = chat(client, model_name, Q1, store=True, conversation=conv.id, metadata={"run": "42"})
    answer = first.choices[0].message.content
    assert answer
    assert texts(client, conv.id) == [("system", "Be brief."), ("user", Q1), ("assistant", answer)]
    assert [r for r, _ in texts(client, conv.id, order="desc")] == ["assistant", "user", "system"]
    stored = client.chat.completions.retrieve(first.id)
    assert stored.metadata == {"run": "42"} and stored.choices[0].message.content == answer

    # `conversation` (here as an object) prepends the history: the prompt is exactly history + new message.
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q1},
               {"role": "assistant", "content": answer}]
    expected = httpx.post(f"{server}/tokenize", headers=auth, json={
        "model": model_name, "messages": history + [{"role": "user", "content": Q2}]}).json()["count"]
    second = chat(client, model_name, Q2, conversation={"id": conv.id})
    assert second.usage.prompt_tokens == expected
    assert chat(client, model_name, Q2).usage.prompt_tokens < expected
    # Without store the conversation is read-only.
    assert len(texts(client, conv.id)) == 3

    # A streamed turn with store: stored once the stream ends, exactly the streamed text.
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": Q2}],
                                            temperature=0, max_tokens=12, stream=True,
                                            extra_body={"store": True, "conversation": conv.id})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert texts(client, conv.id)[-2:] == [("user", Q2), ("assistant", streamed)]

    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model_name, Q2, conversation=conv.id)
    assert e.value.body["code"] == "conversation_not_found"


def test_failed_or_abandoned_generation_stores_nothing(client, model_name, server, auth):
    conv = client.conversations.create()
    with pytest.raises(openai.BadRequestError):  # refused before generating
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=10**6, extra_body={"store": True, "conversation": conv.id})
    body = {"model": model_name, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True, "store": True, "conversation": conv.id}
    trace = f"trace-abort-{time.time_ns()}"
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=auth | {"X-Request-Id": trace}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # the client goes away mid-generation
    # The engine's abort carries the client's request id: the model replica logs `aborted <id>:chatcmpl-...-0`.
    assert wait_for_log(f"aborted {trace}:chatcmpl-"), "no abort line with the request id in the llm replica's log"
    assert texts(client, conv.id) == []


def test_two_keys_cannot_see_each_others_conversations(client, client2, model_name):
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "secret: 1234"}])
    for call in (lambda: client2.conversations.retrieve(conv.id),
                 lambda: client2.conversations.items.list(conv.id),
                 lambda: client2.conversations.update(conv.id, metadata={"x": "y"}),
                 lambda: client2.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                 lambda: client2.conversations.delete(conv.id),
                 lambda: chat(client2, model_name, "Repeat the secret.", conversation=conv.id, store=True)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert "1234" not in str(e.value.body)
    assert texts(client, conv.id) == [("user", "secret: 1234")]  # untouched
    first = chat(client, model_name, "Hi", store=True, conversation=conv.id)
    with pytest.raises(openai.NotFoundError):
        client2.chat.completions.retrieve(first.id)
    # The second tenant's own conversations work as usual, and are invisible to the first.
    mine = client2.conversations.create()
    client2.conversations.items.create(mine.id, items=[{"type": "message", "role": "user", "content": "hello"}])
    assert texts(client2, mine.id) == [("user", "hello")]
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(mine.id)


def test_conversation_request_errors(client, model_name, server, auth):
    r = httpx.post(f"{server}/v1/conversations", headers=auth, json={"metadata": {"k": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    r = httpx.post(f"{server}/v1/conversations", headers=auth,
                   json={"items": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items.0.content.0.type"
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth, json={
        "model": model_name, "messages": [{"role": "user", "content": "x"}], "conversation": {"name": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"
    r = httpx.get(f"{server}/v1/conversations/conv_nope/items", headers=auth, params={"limit": 0})
    assert r.status_code == 400
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": f"m{i}"}
                                              for i in range(3)])
    page = client.conversations.items.list(conv.id, limit=2, order="asc")
    assert page.has_more and [i.content[0].text for i in page.data] == ["m0", "m1"]
    assert [i.content[0].text for i in page.get_next_page().data] == ["m2"]


def test_a_conversation_without_room_for_a_turn_is_refused_before_it_runs(client, model_name, server, auth):
    """A conversation filled to a few hundred characters short of its 16 Mi bound: a stored turn needs room for
    its input and its output's allowance, so even streamed it is a plain 400 `conversation_full` before the
    model runs, and nothing is added. A Responses turn with truncation "auto" (the oldest turns dropped to fit
    the model's context) used to be generated and then fail to be stored, its answer lost; a chat turn is
    refused by the same check, before its history is rendered."""
    cid = client.conversations.create().id
    for _ in range(5):  # 15 texts of 1 Mi characters, 3 to a request (under max_request_bytes)
        client.conversations.items.create(cid, items=[{"type": "message", "role": "user",
                                                       "content": "x" * (1 << 20)}] * 3)

    def stored_chars() -> int:  # as the store counts them: each item's JSON
        r = httpx.get(f"{server}/v1/conversations/{cid}/items", headers=auth, params={"limit": 100})
        return sum(len(json.dumps(item)) for item in r.json()["data"])

    before = stored_chars()
    client.conversations.items.create(cid, items=[{"type": "message", "role": "user", "content": "y"}])
    overhead = stored_chars() - before - 1  # one item's JSON beside its text
    client.conversations.items.create(cid, items=[{"type": "message", "role": "user", "content":
                                                   "z" * ((16 << 20) - stored_chars() - overhead - 600)}])
    assert (16 << 20) - stored_chars() == 600
    with pytest.raises(openai.BadRequestError) as exc:  # streamed: still a 400, before any event
        client.responses.create(model=model_name, input="Hi", conversation=cid, max_output_tokens=12, stream=True,
                                truncation="auto")
    assert (exc.value.body["code"], exc.value.body["param"]) == ("conversation_full", "conversation")
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=12, stream=True, extra_body={"store": True, "conversation": cid})
    assert (exc.value.body["code"], exc.value.body["param"]) == ("conversation_full", "conversation")
    assert len(client.conversations.items.list(cid, limit=100).data) == 17 and stored_chars() == (16 << 20) - 600


def test_items_of_any_input_type_are_added_read_and_deleted_one_by_one(client, client2):
    """Any Responses input item goes into a conversation, with the server's ids (a client's is replaced);
    one item is read, and deleted (the answer: the Conversation), by id; a missing or deleted item is a 404
    `item_not_found`, another key's conversation a 404 `conversation_not_found`."""
    from openai.types.conversations import Conversation
    from openai.types.responses import ResponseFunctionToolCallItem

    conv = client.conversations.create()
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "id": "fc_chosen_by_the_client"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Mild."}]}]).data
    assert [i.type for i in added] == ["message", "function_call", "function_call_output", "reasoning"]
    assert [i.id.split("_")[0] for i in added] == ["msg", "fc", "fco", "rs"]
    call = client.conversations.items.retrieve(added[1].id, conversation_id=conv.id)
    assert isinstance(call, ResponseFunctionToolCallItem) and call == added[1]
    assert call.id != "fc_chosen_by_the_client" and call.arguments == '{"city": "Paris"}'
    after = client.conversations.items.delete(added[1].id, conversation_id=conv.id)
    assert isinstance(after, Conversation) and after.id == conv.id
    assert [i.id for i in client.conversations.items.list(conv.id, order="asc").data] == [
        added[0].id, added[2].id, added[3].id]
    for who, item_id, code in ((client, added[1].id, "item_not_found"), (client2, added[0].id, "conversation_not_found")):
        for method in (who.conversations.items.retrieve, who.conversations.items.delete):
            with pytest.raises(openai.NotFoundError) as e:
                method(item_id, conversation_id=conv.id)
            assert e.value.code == code
    assert len(client.conversations.items.list(conv.id).data) == 3  # the other key's delete changed nothing


def test_postgresql_storage_through_serve(server, postgres_url, auth, model_name):
    """A second application whose ingress stores in a real PostgreSQL server (multi-node storage)."""
    from ray import serve

    from rayllm.serve.builder import build_app

    key = auth["Authorization"].removeprefix("Bearer ")
    app = build_app({"api_keys": [key, "other-key"], "storage_url": postgres_url, "engine": {
        "model": {"dtype": "float32", "max_model_len": 1024}, "cache": {"kv_cache_bytes": 64 << 20}}})
    serve.run(app, name="pg", route_prefix="/pg", blocking=False)
    try:
        pg = openai.OpenAI(base_url=f"{server}/pg/v1", api_key=key, max_retries=0, timeout=120)
        deadline = time.time() + 240
        while True:
            try:
                conv = pg.conversations.create(metadata={"db": "postgres"})
                break
            except (openai.APIStatusError, openai.APIConnectionError):
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        first = chat(pg, model_name, Q1, store=True, conversation=conv.id, metadata={"run": "pg"})
        assert texts(pg, conv.id) == [("user", Q1), ("assistant", first.choices[0].message.content)]
        assert pg.chat.completions.retrieve(first.id).metadata == {"run": "pg"}
        assert chat(pg, model_name, Q2, conversation=conv.id).usage.prompt_tokens > \
            chat(pg, model_name, Q2).usage.prompt_tokens
        other = openai.OpenAI(base_url=f"{server}/pg/v1", api_key="other-key", max_retries=0, timeout=120)
        with pytest.raises(openai.NotFoundError):
            other.conversations.items.list(conv.id)
        with psycopg_connect(postgres_url) as conn:  # really in PostgreSQL
            n = conn.execute("SELECT count(*) FROM conversation_items WHERE conversation_id = %s", (conv.id,))
            assert n.fetchone()[0] == 2
        assert pg.conversations.delete(conv.id).deleted
    finally:
        serve.delete("pg", _blocking=False)


def psycopg_connect(url: str):
    import psycopg

    return psycopg.connect(url)


def test_store_reasoning_keeps_the_thought(client, model_name, server, auth):
    # The thinking fixture of test_tools: the model's real output is <think>...</think> answer.
    from test_tools import THINK_TEMPLATE, THINKING

    def turn(store_reasoning: bool):
        conv = client.conversations.create()
        r = client.chat.completions.create(
            model=model_name, messages=THINKING, temperature=0, max_tokens=60,
            extra_body={"chat_template": THINK_TEMPLATE, "store": True, "conversation": conv.id,
                        "store_reasoning": store_reasoning})
        items = httpx.get(f"{server}/v1/conversations/{conv.id}/items", params={"order": "asc"},
                          headers=auth).json()["data"]
        return r.choices[0].message, items

    msg, items = turn(True)
    assert msg.reasoning_content and [i["type"] for i in items] == ["message", "reasoning", "message"]
    assert items[1]["content"][0]["text"] == msg.reasoning_content
    assert items[2]["content"][0]["text"] == msg.content  # the answer alone, without the thought
    _, items = turn(False)
    assert [i["type"] for i in items] == ["message", "message"]
