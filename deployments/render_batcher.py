"""The ingress's chat renders of one model, coalesced into `render_chat_batch` calls to the tokenizer deployment.

A call through a Serve handle costs milliseconds of latency and CPU on both sides on a busy machine, against
~0.1 ms of rendering: renders that arrive while `max_in_flight` calls are out go together in the next call,
so the number of calls grows with the load only up to `max_in_flight` at a time (a lone request still makes
one call of its own at once). Each request gets its own result or its own client error (a `ValueError`).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Protocol

RenderResult = tuple[str, list[int]]


class _BatchCall(Protocol):
    def remote(self, calls: list[tuple[list[dict], dict[str, Any]]]) -> Any: ...


class _BoundTokenizer(Protocol):
    """The tokenizer deployment bound to one model (deployments.model_routes.ModelTokenizer)."""

    render_chat_batch: _BatchCall


class RenderBatcher:
    def __init__(self, tokenizer: _BoundTokenizer, max_in_flight: int = 2, max_batch: int = 64):
        self.tokenizer = tokenizer
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self._pending: list[tuple[list[dict], dict[str, Any], asyncio.Future]] = []
        self._in_flight = 0
        self._senders: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks
        self.calls = 0  # batch calls made (how well renders coalesce)

    async def render(self, messages: list[dict], **kw: Any) -> RenderResult:
        """`TokenizerDeployment.render_chat`'s result for the model's own template (no `chat_template`)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((messages, kw, future))
        if self._in_flight < self.max_in_flight:
            self._in_flight += 1
            # A context of its own: Serve cancels the calls made in a request's context with that request,
            # and this call carries other requests' renders too.
            task = asyncio.get_running_loop().create_task(self._send(), context=contextvars.Context())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        result = await future
        if isinstance(result, ValueError):
            raise result
        return result

    async def _send(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
                batch = [item for item in batch if not item[2].done()]  # drop requests cancelled while queued
                if not batch:
                    continue
                self.calls += 1
                try:
                    results = await self.tokenizer.render_chat_batch.remote([(m, kw) for m, kw, _ in batch])
                except Exception as exc:  # the call itself failed (replica gone...): each of its requests sees it
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (*_, future), result in zip(batch, results, strict=True):
                    if not future.done():  # a request cancelled meanwhile no longer waits
                        future.set_result(result)
        finally:
            self._in_flight -= 1
