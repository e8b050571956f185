"""`AsyncLLMEngine`: runs an `LLMEngine` on a background thread (torch releases the GIL), or drives one
in its own process (engine_process.EngineProcess), and hands each request an async iterator of outputs.
A request that fails alone (`RequestOutput.error`) raises `SequenceError` from its iterator only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from model_parallel.outputs import EngineDeadError, RequestOutput, SequenceError
from model_parallel.sampling_inputs import describe
from model_parallel.sampling_params import SamplingParams

if TYPE_CHECKING:
    from model_parallel.config import EngineConfig
    from model_parallel.engine import LLMEngine

log = logging.getLogger("model_parallel.engine")


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Coalesce outputs that queued up while the consumer was busy: fewer hops per token."""
    a.new_token_ids = a.new_token_ids + b.new_token_ids
    if b.logprobs:
        a.logprobs = (a.logprobs or []) + b.logprobs
    a.prompt_logprobs = a.prompt_logprobs or b.prompt_logprobs
    if b.hidden_states:
        a.hidden_states = (a.hidden_states or []) + b.hidden_states
    a.embedding = a.embedding or b.embedding
    a.finished, a.finish_reason, a.stop_token_id = b.finished, b.finish_reason, b.stop_token_id
    a.num_cached_tokens = b.num_cached_tokens
    return a


class AsyncLLMEngine:
    """Drives an LLMEngine from a background thread; requests are async iterators of outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._in_process = getattr(engine, "is_process", False)  # an EngineProcess steps in its own process
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, eos_token_ids: list[int] | None = None) -> AsyncLLMEngine:
        from model_parallel.engine import LLMEngine

        return cls(LLMEngine(config, eos_token_ids))

    def _start(self) -> None:
        started = self._loop is not None
        self._loop = asyncio.get_running_loop()  # outputs go to the loop of the latest caller
        if started:
            return
        if self._in_process:  # engine_process.EngineProcess: it steps on its own
            self.engine.attach(self._deliver, self._on_death)
        else:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def _submit(self, command: tuple) -> None:
        if self._in_process:
            kind, *args = command
            (self.engine.add_request if kind == "add" else self.engine.abort)(*args)
        else:
            self._commands.append(command)
            self._wake.set()

    def _on_death(self, exc: BaseException) -> None:
        """The engine process exited or its step failed: fail every open request, report unhealthy."""
        self.error = exc
        self._deliver([(rid, EngineDeadError(f"engine failed: {exc}")) for rid in list(self._queues)])

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            while self._commands:
                kind, *args = self._commands.popleft()
                try:
                    if kind == "add":
                        engine.add_request(*args)
                    else:
                        engine.abort(*args)
                except Exception as exc:  # refused (ValueError) or failed: that request alone
                    self._deliver([(args[0], exc if isinstance(exc, ValueError) else SequenceError(args[0], describe(exc)))])
            if not engine.has_work():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # the engine is unusable: fail every request, report unhealthy
                log.exception("engine step failed")
                self.error = exc
                self._deliver([(rid, EngineDeadError(f"engine failed: {exc}")) for rid in list(self._queues)])
                return
            if outputs:
                self._deliver([(o.request_id, o) for o in outputs])

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[tuple[str, object]]) -> None:
        for rid, item in items:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(item)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora_slot: int = 0,
        grammar: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        self._start()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._submit(("add", request_id, prompt_token_ids, params, lora_slot, grammar))
        finished = False
        try:
            while not finished:
                item = await q.get()
                # Coalesce whatever else is already here.
                while not q.empty() and isinstance(item, RequestOutput) and not item.finished:
                    nxt = q.get_nowait()
                    item = _merge(item, nxt) if isinstance(nxt, RequestOutput) else nxt
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise SequenceError(request_id, item.error)
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.error is None:  # consumer went away (client disconnect): free its blocks
                self._submit(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.shutdown()
