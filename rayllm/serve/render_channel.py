"""A direct channel from the ingress to a tokenizer replica on the same node, for chat renders.

A call through a Serve handle costs many times the render itself, even to a method that does nothing (the
router, the replica's request machinery, a rejection round for strict `max_ongoing_requests`); a Unix
socket to another process costs a small fraction of the render (docs/benchmarks.md). So each tokenizer
replica also listens on a Unix socket in a private directory (`RenderServer`), and an ingress on the same
node sends its renders there (`RenderChannel`): length-prefixed JSON frames, pipelined on one connection.
The replica stays a Serve deployment (its other methods, request templates, autoscaling, health); the
ingress falls back to the handle when the channel is not there or breaks (rayllm.serve.render_batcher).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any, Protocol

from rayllm.serve.tracing import remote_span

log = logging.getLogger("ray.serve")
RenderResult = tuple[str, list[int]]
# What a channel render may carry: the model's own template only (a request's template renders in the sandbox).
RENDER_KWARGS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
_LEN = 4  # bytes of each frame's length prefix (little-endian)
# An input this large (characters, or bytes of a frame) is rendered or tokenized in a thread: it would hold an
# event loop for milliseconds to seconds. A smaller one runs inline (a thread hop costs more than it does).
LARGE_INPUT = 16 << 10


class _Renders(Protocol):
    def render_chat(self, messages: list[dict], **kw: Any) -> RenderResult: ...


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()  # ASCII escapes: any str survives, lone surrogates too
    return len(body).to_bytes(_LEN, "little") + body


async def _read_body(reader: asyncio.StreamReader) -> bytes:
    size = int.from_bytes(await reader.readexactly(_LEN), "little")
    return await reader.readexactly(size)


class RenderServer:
    """Serves `[id, model, messages, kwargs]` frames with `[id, text, ids, error, client_error]` on its own thread
    and loop (client_error: the error is the request's, a 400, rather than ours, a 500)."""

    def __init__(self, services: dict[str, _Renders]):
        self.services = services
        self._dir = tempfile.mkdtemp(prefix="rayllm-render-")  # mode 0700: this user's processes only
        self.path = os.path.join(self._dir, "render.sock")
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._closed = False
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="render-channel", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the render channel did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_unix_server(self._serve, self.path))
        started.set()
        self._loop.run_forever()

    def _answer(self, body: bytes) -> bytes:
        rid, model, messages, kw = json.loads(body)
        service = self.services.get(model)
        if service is None:
            return _frame([rid, None, None, f"no tokenizer for model {model!r}", True])
        try:
            with remote_span("tokenizer.render", kw.get("traceparent"), **{"gen_ai.request.model": model}):
                text, ids = service.render_chat(messages, **{k: v for k, v in kw.items() if k in RENDER_KWARGS})
        except ValueError as exc:  # the client's (template or message shape): its request gets a 400
            return _frame([rid, None, None, str(exc), True])
        except Exception as exc:  # a fault of ours: this request fails, the connection serves the others on
            log.exception("render channel: rendering a request for %r failed", model)
            return _frame([rid, None, None, f"render failed: {type(exc).__name__}: {exc}", False])
        return _frame([rid, text, ids, None, False])

    async def _answer_in_thread(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        answer = await asyncio.to_thread(self._answer, body)
        if not writer.is_closing():
            writer.write(answer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        large: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks
        try:
            while True:
                body = await _read_body(reader)
                if len(body) <= LARGE_INPUT:
                    writer.write(self._answer(body))
                else:  # off this loop, as a task of its own: the renders behind it need not wait (answers carry ids)
                    task = asyncio.create_task(self._answer_in_thread(body, writer))
                    large.add(task)
                    task.add_done_callback(large.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the ingress went away
        finally:
            self._writers.discard(writer)
            writer.close()

    def close(self) -> None:
        """Stops listening and ends every open connection (their clients fall back to the handle); the socket's
        directory goes in any case. At interpreter exit (a replica object dropped with its module) the loop's
        daemon thread no longer runs: nothing is waited for then, which the connections' end makes moot."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()

        try:
            if self._thread.is_alive() and not sys.is_finalizing():
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


class RenderChannel:
    """The ingress's end: one connection, requests pipelined, answers matched by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self.closed = False
        # A context of its own: the reader serves every request, not the one that happened to connect.
        self._reading = contextvars.Context().run(asyncio.get_running_loop().create_task, self._read())

    @classmethod
    async def connect(cls, path: str) -> RenderChannel:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer)

    async def render(self, model: str, messages: list[dict], kw: dict[str, Any]) -> RenderResult | Exception:
        """The render's result, or its error: the client's (ValueError) or the replica's (RuntimeError). Raises
        ConnectionError when the channel is gone (nothing was rendered for this request: retry elsewhere),
        TypeError when the request is not JSON."""
        if self.closed:
            raise ConnectionError("the render channel is closed")
        frame = _frame([self._next_id, model, messages, kw])
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        self._next_id += 1
        self._writer.write(frame)
        return await future

    async def _read(self) -> None:
        try:
            while True:
                rid, text, ids, error, client_error = json.loads(await _read_body(self._reader))
                future = self._pending.pop(rid, None)
                if future is not None and not future.done():
                    future.set_result((text, ids) if error is None else
                                      ValueError(error) if client_error else RuntimeError(error))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError):
            pass
        finally:
            self.closed = True
            self._writer.close()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the tokenizer replica's render channel closed"))
            self._pending.clear()
