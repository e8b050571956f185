"""Storing a completion from its generation state; a store that fails after generation loses nothing."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from rayllm.protocol import protocol as P
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.serve.stores.completion_store import completion_store
from rayllm.serve.stores.conversation_store import ConversationStore, StorageUnavailable


def generated(texts: list[str], finish: str | None = "stop") -> GenerationState:
    state = GenerationState()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        state.add(GenerationDelta(index=0, text=text, token_ids=[i], logprobs=None,
                                  finish_reason=finish if last else None, matched_stop=None, prompt_tokens=5,
                                  cached_tokens=0, completion_tokens=i + 1))
    return state


def test_a_failed_store_carries_the_completion_in_the_503(tmp_path):
    """The database is locked when generation ends: the client saw every delta (a stream), and the 503
    it gets instead of the final body holds the whole completion (error.completion), with
    x-should-retry: false so OpenAI's SDKs do not pay for the generation again."""
    store = ConversationStore(f"sqlite:///{tmp_path}/conv.db", timeout_s=0.3)
    req = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "store": True})
    save = completion_store(store, "m", "owner", req, None, "chatcmpl-1", {"role": "user", "content": "hi"})
    holder = sqlite3.connect(tmp_path / "conv.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageUnavailable) as err:
            asyncio.run(save(generated(["Hel", "lo", "!"])))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    body = err.value.to_dict()["error"]
    assert err.value.status_code == 503 and body["code"] == "storage_unavailable"
    assert body["completion"]["id"] == "chatcmpl-1"
    assert body["completion"]["choices"][0]["message"]["content"] == "Hello!"
    assert err.value.headers == {"x-should-retry": "false"}
    assert store.get_completion("owner", "chatcmpl-1") is None  # nothing half-stored
    # An aborted generation stores nothing; with the lock gone a whole one is stored.
    asyncio.run(save(generated(["Hel", "lo"], finish="abort")))
    assert store.get_completion("owner", "chatcmpl-1") is None
    asyncio.run(save(generated(["Hel", "lo", "!"])))
    assert store.get_completion("owner", "chatcmpl-1")["choices"][0]["message"]["content"] == "Hello!"
