"""Request-supplied chat templates, rendered in a child process with a time, memory and output bound.

Jinja's sandbox blocks code, not resources: `{{ "x" * 10**9 }}` or nested `range` loops run as long
and grow as large as they like, and a thread cannot be stopped. So a client's template renders in a
child process of the tokenizer replica (the same ChatRenderer, on its own copy of the tokenizer),
under an address-space limit; a render that outlives its time limit (CPU seconds of the child, the wall
clock capped at a multiple: rayllm.common.child) is answered with a 400 and the
child is killed and replaced. The model's own template never goes through here.
"""

from __future__ import annotations

import asyncio
import resource
from multiprocessing.connection import Connection
from typing import Any

from rayllm.common import child
from rayllm.protocol.errors import APIError

RENDER_TIMEOUT_S = 2.0
MAX_OUTPUT_CHARS = 1 << 20  # a rendered prompt longer than this is refused (the context is far shorter)
MEMORY_BYTES = 1 << 30  # address space the child may add beyond what the loaded tokenizer takes
START_TIMEOUT_S = 120.0  # loading the tokenizer in the child (the first start may build its snapshot)
MAX_WAITING = 4  # renders that wait for the child beside the one it renders; more are answered busy at once


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(conn: Connection) -> None:
    from rayllm.serve.chat_template import ChatRenderer, load_serving_tokenizer

    model_path, max_output_chars, memory_bytes = conn.recv()
    # The serving processes' tokenizer (its snapshot: no transformers import): a killed child is back in ~1.5 s.
    renderer = ChatRenderer(load_serving_tokenizer(model_path))
    # Render once before "ready": the first render imports the renderer (transformers.utils, ~1 s), which
    # belongs to the start, not to the first client's time limit.
    renderer.render([{"role": "user", "content": "warm-up"}], chat_template="{{ messages[0]['content'] }}")
    if memory_bytes and _vm_bytes():
        limit = _vm_bytes() + memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    conn.send("ready")
    while True:
        try:
            messages, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = renderer.render(messages, **kwargs)
            if len(text) > max_output_chars:
                conn.send((False, f"the rendered prompt has {len(text)} characters; at most {max_output_chars} "
                                  "are allowed"))
            else:
                conn.send((True, text))
        except MemoryError:
            conn.send((False, "rendering the template ran out of memory"))
        except ValueError as exc:
            conn.send((False, str(exc)))


def _busy() -> APIError:
    return APIError(503, "the chat template renderer is busy; retry the request", type="server_error",
                    code="chat_template_busy")


def _refused(message: str, code: str = "invalid_chat_template") -> APIError:
    return APIError(400, f"chat_template: {message}", param="chat_template", code=code)


class TemplateSandbox:
    """One child process per tokenizer replica; renders one template at a time (others wait their turn,
    within the same time limit)."""

    def __init__(self, model_path: str, *, timeout_s: float = RENDER_TIMEOUT_S,
                 max_output_chars: int = MAX_OUTPUT_CHARS, memory_bytes: int = MEMORY_BYTES):
        self.model_path = model_path
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.memory_bytes = memory_bytes
        self._child = child.ChildWorker("rayllm.serve.template_sandbox", (model_path, max_output_chars, memory_bytes),
                                        START_TIMEOUT_S)

        self._waiting = 0
        self._turn = asyncio.Lock()  # the one render whose thread waits on the child

    def close(self) -> None:
        self._child.close()

    async def render_async(self, messages: list[dict], **kwargs: Any) -> str:
        """render() in a thread, one at a time: the others wait on the event loop, not in threads of the default
        executor (the replica's large encodes and renders need those), up to the wall cap of their time limit
        (child.WALL_FACTOR); past MAX_WAITING waiting, a 503 chat_template_busy at once."""
        if self._waiting >= MAX_WAITING:
            raise _busy()
        self._waiting += 1
        try:
            async with asyncio.timeout(child.WALL_FACTOR * self.timeout_s):
                await self._turn.acquire()
        except TimeoutError:
            raise _busy() from None
        finally:
            self._waiting -= 1
        try:
            return await asyncio.to_thread(self.render, messages, **kwargs)
        finally:
            self._turn.release()

    def render(self, messages: list[dict], **kwargs: Any) -> str:
        try:
            ok, value = self._child.call((messages, kwargs), self.timeout_s)
        except child.ChildBusy:
            raise _busy() from None
        except child.ChildTimeout:  # the only way to stop a render: its process goes
            raise _refused(f"rendering took more than {self.timeout_s:g} s of CPU time", "chat_template_timeout") from None
        except child.ChildDied:  # killed by the memory limit
            raise _refused("rendering the template failed (out of memory)") from None
        except RuntimeError:
            raise APIError(503, "the chat template renderer did not start", type="server_error") from None
        if not ok:
            raise _refused(value)
        return value


if __name__ == "__main__":
    _child(child.connect())
