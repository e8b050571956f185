"""Storing a completion from its delta stream; a store that fails after generation loses nothing."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from app import protocol as P
from app.sse import GenerationDelta
from deployments.conversation_store import ConversationStore, StorageUnavailable
from deployments.store_tap import storing_tap


def deltas(texts: list[str]):
    async def gen():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield GenerationDelta(index=0, text=text, token_ids=[i], logprobs=None,
                                  finish_reason="stop" if last else None, matched_stop=None, prompt_tokens=5,
                                  cached_tokens=0, completion_tokens=i + 1)
    return gen()


async def drain(tap, texts: list[str]) -> list[str]:
    return [d.text async for d in tap(deltas(texts))]


def test_a_failed_store_carries_the_completion_in_the_503(tmp_path):
    """The database is locked when generation ends: the client saw every delta (a stream), and the 503
    it gets instead of the final body holds the whole completion (error.completion), with
    x-should-retry: false so OpenAI's SDKs do not pay for the generation again."""
    store = ConversationStore(f"sqlite:///{tmp_path}/conv.db", timeout_s=0.3)
    req = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "store": True})
    tap = storing_tap(store, "m", "owner", req, None, "chatcmpl-1", {"role": "user", "content": "hi"})
    holder = sqlite3.connect(tmp_path / "conv.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    seen: list[str] = []

    async def run() -> None:
        async for d in tap(deltas(["Hel", "lo", "!"])):
            seen.append(d.text)

    try:
        with pytest.raises(StorageUnavailable) as err:
            asyncio.run(run())
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert seen == ["Hel", "lo", "!"]
    body = err.value.to_dict()["error"]
    assert err.value.status_code == 503 and body["code"] == "storage_unavailable"
    assert body["completion"]["id"] == "chatcmpl-1"
    assert body["completion"]["choices"][0]["message"]["content"] == "Hello!"
    assert err.value.headers == {"x-should-retry": "false"}
    assert store.get_completion("owner", "chatcmpl-1") is None  # nothing half-stored
    # With the lock gone the same tap stores.
    asyncio.run(drain(tap, ["Hel", "lo", "!"]))
    assert store.get_completion("owner", "chatcmpl-1")["choices"][0]["message"]["content"] == "Hello!"
