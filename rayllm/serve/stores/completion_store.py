"""Storing a chat completion (`store`, `conversation`) from its generation state, once generation ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rayllm.protocol import conversations as C
from rayllm.protocol import protocol as P
from rayllm.protocol.choice_state import GenerationState
from rayllm.serve.request_guards import conversation_not_found
from rayllm.serve.stores.conversation_store import ConversationStore, StorageUnavailable


def completion_store(store: ConversationStore, model: str, owner: str, req: P.ChatCompletionRequest,
                     cid: str | None, rid: str, last_input: dict) -> Callable[[GenerationState], Awaitable[None]]:
    """What the stream loop calls after the last delta: stores the completion (and the turn, in the
    conversation), reading the same per-choice state the response was written from.

    The write happens after the last delta and before the response ends (the stream's [DONE] or the
    JSON body), in one transaction: a failed or aborted generation stores nothing, and a client that
    saw the end of its response can rely on it being stored. When the write fails, the response is a
    503 `storage_unavailable` whose error object carries the completion (`error.completion`).
    """
    async def save(state: GenerationState) -> None:
        if not state.complete():
            return  # not a whole generation: nothing is stored
        choices = [{"index": c.index, "message": {"role": "assistant"} | c.message(), "logprobs": None,
                    "finish_reason": c.reason()} for c in state.sorted_choices()]
        first = choices[0]["message"]
        think = first.pop("reasoning_content", None)
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": state.usage()}
        if req.store_reasoning and think is not None:
            first["reasoning_content"] = think
        items = C.turn_items(last_input, first["content"] or "", think if req.store_reasoning else None) \
            if cid else None
        try:
            await asyncio.to_thread(store.save_completion, owner, body, req.metadata, cid, items)
        except KeyError:
            raise conversation_not_found(cid or "") from None
        except StorageUnavailable:  # the 503 carries what was generated (a stream has sent it already)
            raise StorageUnavailable("the completion was generated but could not be stored (storage is "
                                     "unavailable); it is in error.completion", completion=body) from None

    return save
