"""Storing a chat completion (`store`, `conversation`) from its delta stream, once generation ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from app import conversations as C
from app import protocol as P
from app.chat_output import merge_deltas
from app.sse import GenerationDelta, UsageCounter
from deployments.conversation_store import ConversationStore, StorageUnavailable
from deployments.request_guards import conversation_not_found


def storing_tap(store: ConversationStore, model: str, owner: str, req: P.ChatCompletionRequest, cid: str | None,
                rid: str, last_input: dict, parser_factory=None):
    """A delta tap that stores the completion (and the turn, in the conversation) once generation ends.

    The write happens after the last delta and before the response ends (the stream's [DONE] or the
    JSON body), in one transaction: a failed or aborted generation stores nothing, and a client that
    saw the end of its response can rely on it being stored. When the write fails, the response is a
    503 `storage_unavailable` whose error object carries the completion (`error.completion`).
    """
    async def tap(deltas: AsyncIterator[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
        usage = UsageCounter(req.n or 1)
        texts: dict[int, list[str]] = {}
        finish: dict[int, str | None] = {}
        async for d in deltas:
            usage.add(d)
            texts.setdefault(d.index, []).append(d.text)
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason
            yield d
        if any(finish.get(i) in (None, "abort") for i in texts):
            return  # not a whole generation: nothing is stored
        choices = []
        for i in sorted(texts):
            message: dict = {"role": "assistant", "content": "".join(texts[i])}
            reason = finish[i]
            if parser_factory is not None:  # the same split as the response: thoughts, answer, tool calls
                parser = parser_factory()
                message |= merge_deltas(parser.feed(message["content"], final=True))
                reason = parser.finish_reason(reason)
            choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": reason})
        first = choices[0]["message"]
        think = first.pop("reasoning_content", None)
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.to_dict()}
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

    return tap
