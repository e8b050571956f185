"""One async client interface to the engine, wherever it steps (as vLLM v1's EngineCoreClient):

- `InprocClient`: an `LLMEngine` stepping on a thread of this process (torch releases the GIL).
- `ProcessClient`: an engine stepping in a child process (engine_process.EngineProcess), so the serving
  process's Python never shares the engine's GIL.

`make_engine_client` picks one. Each request is an async iterator of `RequestOutput`; a request that
fails alone (`RequestOutput.error`) raises `SequenceError` from its iterator only, and an engine that
dies fails every open request with `EngineDeadError`.

Commands (add, abort, and the calls behind stats, health and LoRA loads) reach the engine between two
steps in the order they were made: an adapter unload made after its requests' aborts finds their
sequences gone. (An add whose grammar an engine process lacks goes out from a thread once the grammar is
serialized, possibly after later requests' adds, but before anything its own request does next.)
The calls block until the engine answers: make them from a thread, not an event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rayllm.common.errors import describe
from rayllm.schema.outputs import EngineDeadError, RequestOutput, SequenceError
from rayllm.schema.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rayllm.engine.client.engine_process import EngineProcess
    from rayllm.engine.engine import EngineStats, LLMEngine
    from rayllm.schema.config import EngineConfig, LlamaArch

log = logging.getLogger("rayllm.engine.engine")

# The engine thread re-takes the GIL between hundreds of small torch ops per step; with the default
# 5 ms switch interval, every hand-off from the asyncio thread stalls it that long.
GIL_SWITCH_INTERVAL_S = 0.0002
CALL_TIMEOUT_S = 300.0  # LoRA loads read files; stats and health are answered within a step
HEALTH_TIMEOUT_S = 60.0


# generate's on_end: the request's last output from the engine (its timings), or None if none came.
OnEnd = Callable[[RequestOutput | None], None]


def _report(on_end: OnEnd | None, out: RequestOutput | None) -> None:
    """Call a request's on_end; a fault in it (tracing) is logged, never the request's nor its neighbours'."""
    if on_end is not None:
        try:
            on_end(out)
        except Exception:
            log.exception("on_end of request %s failed", out.request_id if out is not None else "?")


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
    a.error = b.error
    a.timings = b.timings
    return a


class EngineClient(ABC):
    """The engine as the serving layer sees it: requests, aborts, stats, health, LoRA slots, shape."""

    # True when the engine steps in a child process: this process's Python never holds the engine's GIL.
    in_child_process = False

    def __init__(self, arch: LlamaArch, max_model_len: int, capacity_tokens: int) -> None:
        self.arch = arch
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens  # KV cache size in tokens
        self.startup_phases: dict[str, float] = {}  # the engine's cold start (rayllm.common.startup_phases)
        self.error: BaseException | None = None  # set once the engine is dead
        self._queues: dict[str, asyncio.Queue] = {}
        self._ends: dict[str, OnEnd] = {}  # generate's on_end of requests left early, until the engine's last output
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    # ---- what each implementation provides ----

    @abstractmethod
    def _submit(self, command: tuple) -> None:
        """Queue ("add", request_id, prompt, params, lora_slot, grammar) or ("abort", request_id)."""

    async def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora_slot: int,
                   grammar: Any) -> None:
        """Queue the request (ProcessClient may first have to send its grammar to the engine process)."""
        self._submit(("add", request_id, prompt_token_ids, params, lora_slot, grammar))

    @abstractmethod
    def _call(self, method: str, *args: Any, timeout: float) -> Any:
        """Run `method` (a dotted name on the LLMEngine, e.g. 'executor.load_lora') between two steps."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and free what it holds; open requests are not answered."""

    # ---- the interface ----

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lora_slot: int = 0, grammar: Any = None,
                       on_end: OnEnd | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs, one or more steps' worth each; the last has `finished`. Leaving the
        iterator early (close, cancellation) aborts the request. grammar: an xgrammar CompiledGrammar.

        on_end (tracing: the engine's timings) is called once, on the event loop, with the request's last
        output from the engine: its finished one (before it is yielded; also one that fails the request),
        or, when the iterator was left early, the abort's acknowledgement, which may come after the iterator
        closed; None if the engine sends none (refused, dead)."""
        if self.error is not None:
            _report(on_end, None)
            raise EngineDeadError(f"engine failed: {self.error}")
        self._loop = asyncio.get_running_loop()  # outputs go to the loop of the latest caller
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q  # before the add: its outputs may come before _add returns
        try:
            await self._add(request_id, prompt_token_ids, params, lora_slot, grammar)
        except BaseException:  # refused before it was sent (ValueError), or cancelled (then _add aborted it)
            self._queues.pop(request_id, None)
            _report(on_end, None)
            raise
        finished = False
        try:
            while not finished:
                item = await q.get()
                while not q.empty() and isinstance(item, RequestOutput) and not item.finished:
                    nxt = q.get_nowait()
                    item = _merge(item, nxt) if isinstance(nxt, RequestOutput) else nxt
                if isinstance(item, BaseException):
                    finished = True  # refused, or the engine is dead: nothing of it is left to abort
                    _report(on_end, None)
                    raise item
                finished = item.finished
                if finished:
                    _report(on_end, item)
                if item.error is not None:
                    raise SequenceError(request_id, item.error)
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                if on_end is not None:
                    self._end_later(request_id, q, on_end)
                if self.error is None:  # consumer went away (client disconnect): free its blocks
                    self.abort(request_id)

    def _end_later(self, request_id: str, q: asyncio.Queue, on_end: OnEnd) -> None:
        """The consumer left before the last output: on_end gets the one already queued (the engine ended the
        request meanwhile), else the next one _dispatch sees for it (the abort's), or None on the engine's death."""
        while not q.empty():
            item = q.get_nowait()
            if isinstance(item, BaseException) or item.finished:
                return _report(on_end, item if isinstance(item, RequestOutput) else None)
        if self.error is not None:
            return _report(on_end, None)
        self._ends[request_id] = on_end

    def abort(self, request_id: str) -> None:
        """End a request: its iterator gets a last output with finish_reason 'abort'; a no-op once finished."""
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._call("stats", timeout=30.0)

    def check_health(self) -> None:
        """Raises if the engine is dead or does not answer (a hung step, a tensor-parallel rank gone)."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        self._call("executor.check_health", timeout=HEALTH_TIMEOUT_S)

    def load_lora(self, slot: int, lora_id: int, path: str) -> int:
        """Every rank reads its shard of the PEFT adapter at `path` into `slot`; sequences name it by `lora_id`."""
        return self._call("executor.load_lora", slot, lora_id, path, timeout=CALL_TIMEOUT_S)

    def unload_lora(self, slot: int) -> None:
        self._call("executor.unload_lora", slot, timeout=CALL_TIMEOUT_S)

    # ---- outputs back to the requests' queues (from the engine thread or the pipe's reader) ----

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[tuple[str, object]]) -> None:
        for rid, item in items:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(item)
            elif rid in self._ends:  # a request left early: its on_end waits for its last output
                last = item if isinstance(item, RequestOutput) else None  # or the engine's death
                if last is None or last.finished:
                    _report(self._ends.pop(rid), last)

    def _on_death(self, exc: BaseException) -> None:
        """The engine's step failed or its process exited: fail every open request, report unhealthy."""
        self.error = exc
        self._deliver([(rid, EngineDeadError(f"engine failed: {exc}")) for rid in [*self._queues, *self._ends]])


def _resolve(engine: LLMEngine, method: str) -> Any:
    target: Any = engine
    for part in method.split("."):
        target = getattr(target, part)
    return target


class InprocClient(EngineClient):
    """Steps an LLMEngine on a thread of this process; commands wait in a queue for the next step boundary."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.arch, engine.max_model_len, engine.capacity_tokens)
        self.engine = engine
        self.startup_phases = engine.startup_phases
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # a command is either queued before the loop ends, or refused
        self._closed = False
        self._stopped = False
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def _submit(self, command: tuple) -> None:
        with self._lock:
            if not self._closed:
                self._commands.append(command)
                self._wake.set()
                return
        self._refuse(command)

    def _refuse(self, command: tuple) -> None:
        error = EngineDeadError(f"engine failed: {self.error}" if self.error is not None else "engine stopped")
        if command[0] == "call":
            command[1].set_exception(error)
        elif command[0] in ("add", "abort"):  # an abort's on_end (a request left early) learns none will come
            self._deliver([(command[1], error)])

    def _call(self, method: str, *args: Any, timeout: float) -> Any:
        fut: Future = Future()
        self._submit(("call", fut, method, args))
        return fut.result(timeout=timeout)

    def _handle(self, command: tuple) -> None:
        kind, *args = command
        if kind == "call":
            fut, method, call_args = args
            try:
                fut.set_result(_resolve(self.engine, method)(*call_args))
            except Exception as exc:
                fut.set_exception(exc)
            return
        rid = args[0]
        try:
            if kind == "add":
                self.engine.add_request(*args)
            else:
                out = self.engine.abort(rid)
                if out is not None:
                    self._deliver([(rid, out)])
        except Exception as exc:  # refused (ValueError) or failed: that request alone
            self._deliver([(rid, exc if isinstance(exc, ValueError) else SequenceError(rid, describe(exc)))])

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                while self._commands and not self._stopped:
                    self._handle(self._commands.popleft())
                if not engine.has_work():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                if outputs:
                    self._deliver([(o.request_id, o) for o in outputs])
        except BaseException as exc:  # the engine is unusable: fail every request, report unhealthy
            log.exception("engine step failed")
            self._on_death(exc)
        finally:
            with self._lock:
                self._closed = True
            while self._commands:
                self._refuse(self._commands.popleft())

    def stop(self) -> None:
        """Stop stepping (the engine itself stays usable by its owner)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def shutdown(self) -> None:
        self.stop()
        self.engine.shutdown()


class ProcessClient(EngineClient):
    """Drives an EngineProcess: commands and calls go down its pipe, outputs come back on its reader thread."""

    in_child_process = True

    def __init__(self, process: EngineProcess) -> None:
        super().__init__(process.arch, process.max_model_len, process.capacity_tokens)
        self.process = process
        self.startup_phases = process.startup_phases
        # A grammar the child lacks is serialized (seconds for a large one) and sent from here, off the event
        # loop; one thread, so health checks and other to_thread work never wait behind it.
        self._grammar_sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-send")
        process.attach(self._deliver, self._on_death)

    def _submit(self, command: tuple) -> None:
        """Aborts (adds go through _add)."""
        _, request_id = command
        try:
            self.process.abort(request_id)
        except EngineDeadError as exc:  # the child died between two sends (its reader reports it too)
            self._deliver([(request_id, exc)])

    async def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora_slot: int,
                   grammar: Any) -> None:
        add = functools.partial(self.process.add_request, request_id, prompt_token_ids, params, lora_slot, grammar)
        try:
            if add(serialize=False):  # no grammar, or one the child holds: a small message, sent from the loop
                return
            sent = asyncio.get_running_loop().run_in_executor(self._grammar_sender, add)
            try:
                await asyncio.shield(sent)
            except asyncio.CancelledError:
                # A thread cannot be stopped: the add goes out regardless. Abort it once it has, and end this task
                # only then, so that what follows the task (an adapter's unload) comes after the abort.
                sent.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(request_id))
                await asyncio.wait([sent])
                raise
        except EngineDeadError as exc:  # the child died between two sends (its reader reports it too)
            self._deliver([(request_id, exc)])

    def _call(self, method: str, *args: Any, timeout: float) -> Any:
        return self.process.call(method, *args, timeout=timeout)

    def shutdown(self) -> None:
        self._grammar_sender.shutdown(wait=False, cancel_futures=True)
        self.process.shutdown()


def steps_in_child(config: EngineConfig, own_process: bool) -> bool:
    """own_process asks for a child process; only a single-rank engine with the default executor gets
    one. Tensor-parallel engines (and executor 'ray') step here: their ranks already run in actors."""
    parallel = config.parallel
    return own_process and parallel.tensor_parallel_size == 1 and parallel.executor == "auto"


def make_engine_client(config: EngineConfig,
                       eos_token_ids: Sequence[int] | Callable[[], Sequence[int]] | None = None, *,
                       own_process: bool = False) -> EngineClient:
    """The one place that decides where the engine steps (see steps_in_child). eos_token_ids may be a
    function (the caller's tokenizer load): with an engine process it runs while the child loads the model."""
    if steps_in_child(config, own_process):
        from rayllm.engine.client.engine_process import EngineProcess

        return ProcessClient(EngineProcess(config, eos_token_ids))
    from rayllm.engine.engine import LLMEngine

    eos = eos_token_ids() if callable(eos_token_ids) else eos_token_ids
    return InprocClient(LLMEngine(config, list(eos) if eos is not None else None))
