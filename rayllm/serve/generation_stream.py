"""The ingress's one stream loop: a model call's batches are read once, each delta is fed once to the
request's GenerationState, and from that state come the SSE bytes (or the whole body), the stored
completion and the request's metrics. One coroutine per batch, no chain of async generators per delta."""

# No `from __future__ import annotations`, like the ingress: this runs inside the Serve replica.

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.io_struct import DeltaBatch
from rayllm.protocol.sse import WireFormat
from rayllm.serve.metrics import ServerMetrics
from rayllm.serve.request_guards import cancel, next_batch
from rayllm.serve.tracing import current_span
from rayllm.serve.tracing_spans import finish_request

OnComplete = Callable[[GenerationState], Awaitable[None]]


class Generation:
    """One request's model call as the ingress serves it (stream or whole body).

    `fmt` writes the wire format from `fmt.state`; `on_complete` (storage) runs after the last delta and
    before the response ends, so a client that saw the end can rely on it.
    """

    def __init__(self, call: Any, fmt: WireFormat, *, metrics: ServerMetrics, model: str, t0: float,
                 timeout_s: float | None, retry_after_s: float, on_complete: OnComplete | None = None) -> None:
        self.call = call
        self.it = aiter(call)
        self.fmt = fmt
        self.state = fmt.state
        self.metrics, self.model, self.t0 = metrics, model, t0
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.deadline = None if timeout_s is None else t0 + timeout_s
        self.on_complete = on_complete
        self.first: DeltaBatch | None = None
        self.replica_id: str | None = None  # set on the first delta by the serving replica
        self.span = current_span()  # the request's span (rayllm.serve.tracing_spans), None unless traced

    @property
    def headers(self) -> dict[str, str]:
        """Debug: the serving replica's id, so tests can see where Serve routed the request."""
        return {"x-replica-id": self.replica_id} if self.replica_id else {}

    async def _next(self) -> DeltaBatch | None:
        had_token = self.state.first_token_at is not None
        batch = await next_batch(self.it, self.deadline, self.timeout_s, self.retry_after_s)
        if batch and not had_token:
            self.replica_id = self.replica_id or batch[0].replica_id
            if any(d.token_ids for d in batch):
                self.metrics.first_token(self.model, time.monotonic() - self.t0)
        return batch

    def _close(self, outcome: str) -> None:
        cancel(self.call)  # a no-op once the call ended; otherwise it aborts the request upstream
        self.metrics.request_done(self.state, self.model, self.t0, outcome)
        if self.span is not None:
            finish_request(self.span, self.state, outcome)

    async def body(self) -> Any:
        """The whole response (a non-streamed request)."""
        outcome = "error"
        try:
            while (batch := await self._next()) is not None:
                for d in batch:
                    choice, pieces = self.state.add(d)
                    self.fmt.feed(choice, d, pieces)
            self.fmt.finish()
            outcome = self.state.outcome()
            if self.on_complete is not None:
                await self.on_complete(self.state)
            return self.fmt.body()
        except asyncio.CancelledError:  # the client went away
            outcome = "abort"
            raise
        finally:
            self._close(outcome)

    async def start(self) -> None:
        """Waits for the first batch before the stream is answered, so early refusals (a full queue, a
        timeout before the first token) are plain HTTP errors."""
        try:
            self.first = await self._next()
        except BaseException:
            self._close("error")
            raise

    async def events(self) -> AsyncIterator[str]:
        """The SSE body: each batch's events as one write."""
        outcome = "error"
        try:
            out = self.fmt.head()
            batch = self.first
            self.first = None
            while batch is not None:
                for d in batch:
                    choice, pieces = self.state.add(d)
                    out += self.fmt.delta(choice, d, pieces)
                if out:
                    yield out
                out = ""
                batch = await self._next()
            finish = self.fmt.finish()
            if finish:
                yield finish
            outcome = self.state.outcome()
            if self.on_complete is not None:
                await self.on_complete(self.state)
            yield self.fmt.tail()
        except Exception as exc:  # the 200 is sent: the failure becomes events
            yield self.fmt.error(exc)
        except BaseException:  # GeneratorExit / cancellation: the client went away
            outcome = "abort"
            raise
        finally:
            self._close(outcome)
