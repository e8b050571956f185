"""The ingress's chat renders of one model: over the tokenizer replica's direct channel when it runs on this
node (rayllm.serve.render_channel), else coalesced into `render_chat_batch` calls through the Serve handle.

A call through a Serve handle costs many times the render in latency and in CPU on both sides
(docs/benchmarks.md): renders that arrive while `max_in_flight` calls are out go together in the next call,
so the number of calls grows with the load only up to `max_in_flight` at a time (a lone request still makes
one call of its own at once). A large render (past LARGE_INPUT) makes a call of its own beside those: in a batch
it would hold one of the `max_in_flight` calls for the seconds it takes, and small renders would wait. Each request gets its own result or its own error: the client's (a `ValueError`,
a 400) or the tokenizer replica's for that request alone (any other exception, a 500).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, Protocol

import ray

from rayllm.protocol.request_models import json_size
from rayllm.serve.render_channel import LARGE_INPUT, RenderChannel, RenderResult

log = logging.getLogger("ray.serve")
RECONNECT_S = 10.0  # after the channel could not be had (or broke), the handle serves this long before a retry


class _Call(Protocol):
    def remote(self, *args: Any) -> Any: ...


class _BoundTokenizer(Protocol):
    """The tokenizer deployment bound to one model (rayllm.serve.routes.model_routes.ModelTokenizer)."""

    model: str
    render_chat_batch: _Call
    render_endpoint: _Call


class RenderBatcher:
    def __init__(self, tokenizer: _BoundTokenizer, max_in_flight: int = 2, max_batch: int = 64, direct: bool = True):
        self.tokenizer = tokenizer
        self.direct = direct  # False: always through the handle
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self._pending: list[tuple[list[dict], dict[str, Any], asyncio.Future]] = []
        self._in_flight = 0
        self._senders: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks
        self.calls = 0  # batch calls made (how well renders coalesce)
        self._channel: RenderChannel | None = None
        self._connecting = False
        self._retry_at = 0.0

    async def render(self, messages: list[dict], **kw: Any) -> RenderResult:
        """`TokenizerDeployment.render_chat`'s result for the model's own template (no `chat_template`)."""
        channel = await self.channel() if self.direct else None
        if channel is not None:
            try:
                result = await channel.render(self.tokenizer.model, messages, kw)
            except (ConnectionError, TypeError):  # the replica went (or JSON cannot carry this): the handle serves
                pass
            else:
                if isinstance(result, Exception):
                    raise result
                return result
        return await self._batched(messages, kw)

    async def channel(self) -> RenderChannel | None:
        """The open channel to a tokenizer replica on this node, if there is one (connects on first use)."""
        if self._channel is not None and not self._channel.closed:
            return self._channel
        if self._connecting or time.monotonic() < self._retry_at:
            return None
        self._connecting, self._channel = True, None
        try:
            endpoint = await self.tokenizer.render_endpoint.remote()
            if endpoint["node_id"] == ray.get_runtime_context().get_node_id():
                self._channel = await RenderChannel.connect(endpoint["path"])
        except Exception as exc:  # an unreachable replica or socket: the handle serves meanwhile
            log.warning("no render channel to the tokenizer (%s: %s); rendering through the handle for %g s",
                           type(exc).__name__, exc, RECONNECT_S)
        finally:
            self._connecting = False
            if self._channel is None:
                self._retry_at = time.monotonic() + RECONNECT_S
        return self._channel

    async def _batched(self, messages: list[dict], kw: dict[str, Any]) -> RenderResult:
        if json_size([messages, kw]) > LARGE_INPUT:  # its own call, outside the batches and their slots
            self.calls += 1
            [result] = await self.tokenizer.render_chat_batch.remote([(messages, kw)])
            if isinstance(result, Exception):
                raise result
            return result
        future = asyncio.get_running_loop().create_future()
        self._pending.append((messages, kw, future))
        if self._in_flight < self.max_in_flight:
            self._in_flight += 1
            # A context of its own: Serve cancels the calls made in a request's context with that request,
            # and this call carries other requests' renders too.
            task = contextvars.Context().run(asyncio.get_running_loop().create_task, self._send())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        result = await future
        if isinstance(result, Exception):
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
