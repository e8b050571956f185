"""Files, keys and tenants against the real app: admin-only adapter routes, no schema with keys on,
prefix-cache isolation between keys, and a store failure that does not lose the generation."""

from __future__ import annotations

import os
import sqlite3
import uuid

import httpx
import openai
import pytest

from tests.serve.conftest import ADMIN_KEY, API_KEY

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

LONG = "Summarize the following notes in one sentence. " + " ".join(f"Note {i}: the sky was clear." for i in range(20))


def hdr(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def cached(client, content: str, **kw) -> int:
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": content}],
                                       max_tokens=1, temperature=0, **kw)
    return r.usage.prompt_tokens_details.cached_tokens


def test_prefix_cache_is_per_key_and_per_cache_salt(client, client2):
    """Key B sending key A's prompt gets no cached tokens (so it cannot learn what A sent), while A's
    repeat does; vLLM's request-level cache_salt separates requests of one key the same way."""
    # Every chat prompt starts with the same system prompt, which a key's earlier requests cached: a fresh
    # salt opens a namespace in which nothing is cached yet, for this key as for any other.
    salt = {"cache_salt": uuid.uuid4().hex}
    assert cached(client, LONG, extra_body=salt) == 0
    assert cached(client, LONG, extra_body=salt) > 0  # A's repeat hits A's blocks
    assert cached(client2, LONG, extra_body=salt) == 0  # B, same salt: a miss, whatever A sent
    assert cached(client2, LONG, extra_body=salt) > 0
    assert cached(client, LONG, extra_body={"cache_salt": uuid.uuid4().hex}) == 0  # another salt of A's
    prompt = f"[{uuid.uuid4().hex}] {LONG}"  # without a salt: B never hits what only A sent
    cached(client, prompt)
    assert cached(client2, prompt) < cached(client, prompt)
    with pytest.raises(openai.BadRequestError) as err:
        cached(client, prompt, extra_body={"cache_salt": "x" * 257})
    assert err.value.body["param"] == "cache_salt"


@pytest.mark.parametrize("route", ["load_lora_adapter", "unload_lora_adapter"])
def test_adapter_routes_need_an_admin_key(server, route):
    body = {"lora_name": "x"} | ({"lora_path": "/etc"} if route == "load_lora_adapter" else {})
    assert httpx.post(f"{server}/v1/{route}", json=body, headers=hdr(None)).status_code == 401
    r = httpx.post(f"{server}/v1/{route}", json=body, headers=hdr(API_KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = httpx.post(f"{server}/v1/{route}", json=body, headers=hdr(ADMIN_KEY))
    if route == "load_lora_adapter":  # past the key: paths are off until the operator lists a root
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_path_disabled"
    else:
        assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"


def test_request_lora_path_is_off_by_default(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, extra_body={"lora_path": "/etc"})
    assert err.value.body["code"] == "lora_path_disabled" and "/etc" not in err.value.body["message"]


def test_no_schema_or_docs_with_keys_on(server):
    from rayllm.serve.routes.http_app import app

    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{server}{path}", headers=hdr(API_KEY)).status_code == 404
    assert "/v1/chat/completions" in app.openapi()["paths"]  # in-process tooling still has it


def test_health_answers_without_internals(server):
    r = httpx.get(f"{server}/health")
    assert r.status_code == 200 and r.content == b""


MODEL = "SmolLM2-135M-Instruct"
COLOR = [{"role": "user", "content": "Name a color."}]
RESPONSE_KW = dict(model=MODEL, input="Name a color.", max_output_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def locked_store(client) -> dict:
    """The three requests of the locked-store tests below, made while one other connection holds the
    conversations database locked: sent at once, so that the store's busy timeout (conftest: 2 s) is waited
    out once, not three times. Each outcome is what the request raised (and, for the stream, the deltas
    received before that). `expected`: the same chat request and Response, unstored, beforehand."""
    from concurrent.futures import ThreadPoolExecutor

    expected = {"chat": client.chat.completions.create(model=MODEL, messages=COLOR, max_tokens=8,
                                                       temperature=0).choices[0].message.content,
                "response": client.responses.create(store=False, **RESPONSE_KW).output_text}
    pieces: list[str] = []

    def stream() -> None:
        for chunk in client.chat.completions.create(model=MODEL, messages=COLOR, max_tokens=8, temperature=0,
                                                    store=True, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)

    def outcome(call) -> Exception | None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001  (the tests below say which error it must be)
            return exc
        return None

    calls = {"json": lambda: client.chat.completions.create(model=MODEL, messages=COLOR, max_tokens=8,
                                                            temperature=0, store=True),
             "stream": stream,
             "response": lambda: client.responses.create(**RESPONSE_KW)}
    holder = sqlite3.connect(os.environ["STORAGE_URL"][len("sqlite:///"):], isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            errors = dict(zip(calls, pool.map(outcome, calls.values()), strict=True))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    return {"expected": expected, "errors": errors, "pieces": pieces}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_locked_store_answers_503_with_the_completion(client, locked_store, stream):
    """The conversations database is locked by another connection when generation ends: the request
    answers 503 storage_unavailable within the busy timeout, and the completion it paid for is in
    error.completion (a stream has sent every delta before its error event); the SDK does not retry."""
    expected = locked_store["expected"]["chat"]
    err = locked_store["errors"]["stream" if stream else "json"]
    if stream:
        assert isinstance(err, openai.APIError), err
        assert "".join(locked_store["pieces"]) == expected
    else:
        assert isinstance(err, openai.InternalServerError), err
        assert err.status_code == 503 and err.response.headers["x-should-retry"] == "false"
    body = err.body
    assert body["code"] == "storage_unavailable"
    assert body["completion"]["choices"][0]["message"]["content"] == expected
    stored = client.chat.completions.create(model=MODEL, messages=COLOR, max_tokens=8,
                                            temperature=0, store=True)  # unlocked: stored again
    assert stored.choices[0].message.content == expected


def test_a_locked_store_answers_503_with_the_response(client, locked_store):
    """The same for /v1/responses (stored by default): the 503 carries the generated Response in
    error.response, and the SDK does not generate again on its own."""
    expected = locked_store["expected"]["response"]
    err = locked_store["errors"]["response"]
    assert isinstance(err, openai.InternalServerError), err
    assert err.status_code == 503 and err.response.headers["x-should-retry"] == "false"
    body = err.body
    assert body["code"] == "storage_unavailable"
    assert body["response"]["output"][-1]["content"][0]["text"] == expected
    assert client.responses.create(**RESPONSE_KW).output_text == expected  # unlocked: stored
