"""The engine loop in its own process, so the serving process's Python never shares its GIL.

In a model replica, the asyncio loop (detokenization, Ray's streaming and serialization) runs
beside the engine. On one GIL, each of the ~1,200 torch ops of a step waits for the GIL after it
returns: measured on 2 CPU cores at 16 concurrent streams, decode steps took ~100 ms in the replica
against ~50 ms offline, with the engine thread on CPU only 61 % of the time. Here the engine
(scheduler, model, sampler) runs in a child process, and the replica talks to it over one pipe:
commands in (add, abort, calls), one message of outputs out per step.

`EngineProcess` is the parent's end of that pipe (add_request, abort, `call` of an engine method between
two steps, and the engine's shape); engine_client.ProcessClient turns it into the engine client.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from rayllm.common.errors import describe
from rayllm.platforms.cpu.onednn_env import onednn_cache_env
from rayllm.schema.config import EngineConfig
from rayllm.schema.outputs import EngineDeadError, RequestRefused, SequenceError

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 900  # model load, KV cache allocation
# A compiled grammar whose JSON is longer is refused (ASCII in practice: characters are bytes). A 12 KB schema
# (200 string properties with patterns) compiled to 132 MB of JSON: seconds to serialize and to read back, and
# ~90 MB in the engine process.
MAX_GRAMMAR_JSON_CHARS = 64 << 20
# Grammars the child keeps deserialized. The parent picks what it drops (in the add that sends a new one), so
# it always knows which keys the child holds; a dropped grammar's running sequences keep their matchers.
GRAMMARS_HELD = 4


def assigned_gpu_ids() -> list[str]:
    """GPU ids Ray assigned this process (the replica), [] outside a Ray worker; Ray is not imported here."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    return [str(g) for g in ray.get_gpu_ids()]


def child_env(environ: dict[str, str], gpu_ids: Sequence[str] = ()) -> dict[str, str]:
    """The child's environment: the parent's, with bounded oneDNN caches unless the operator set them, and
    CUDA_VISIBLE_DEVICES naming exactly the GPUs Ray assigned the replica (`gpu_ids`). Ray sets it so itself,
    but not with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, and the child runs outside Ray: its worker
    would take the first visible GPU, another replica's."""
    env = dict(environ) | onednn_cache_env(environ)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    return env


class EngineProcessError(EngineDeadError):
    """The child is gone (or never started): the serving layer answers 503 and health fails."""


class EngineProcess:
    """Parent side: starts the child, sends commands, and hands step outputs to `on_outputs`."""

    def __init__(self, config: EngineConfig,
                 eos_token_ids: Sequence[int] | Callable[[], Sequence[int]] | None = None):
        """eos_token_ids may be a function: it runs here while the child imports torch and loads the model
        (the replica builds its tokenizer meanwhile), and its ids reach the engine before it reports ready."""
        # A fresh interpreter (`python -m rayllm.engine.client.engine_process FD`), not fork (the replica runs Ray's
        # and torch's threads) nor multiprocessing's spawn (which re-runs the parent's __main__ script).
        parent_sock, child_sock = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "rayllm.engine.client.engine_process", str(child_sock.fileno())],
                                      pass_fds=(child_sock.fileno(),), env=child_env(dict(os.environ), assigned_gpu_ids()))
        child_sock.close()
        self._conn = Connection(os.dup(parent_sock.fileno()))
        parent_sock.close()
        self._conn.send(config)
        try:
            eos = eos_token_ids() if callable(eos_token_ids) else eos_token_ids
        except BaseException:
            self._proc.kill()
            self._proc.wait()
            raise
        try:
            self._conn.send(list(eos or ()))
        except OSError:  # the child failed to start and is gone: its error (or EOF) is read below
            pass
        if not self._conn.poll(_READY_TIMEOUT_S):
            self._proc.kill()
            raise EngineProcessError("the engine process did not start in time")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            raise EngineProcessError(f"the engine process exited during start-up (code {self._proc.wait()})") \
                from None
        if kind == "error":
            self._proc.wait(timeout=10)
            raise info
        self.arch = info["arch"]
        self.max_model_len: int = info["max_model_len"]
        self.capacity_tokens: int = info["capacity_tokens"]
        self.startup_phases: dict[str, float] = info.get("startup", {})
        self.config = config
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._tokenizer_info_sent = False
        self._grammar_lock = threading.Lock()  # one grammar serialized and sent at a time
        self._keys_lock = threading.Lock()
        self._grammar_keys: dict[int, int] = {}  # id(CompiledGrammar) -> key, while the object lives
        self._grammar_ids = itertools.count()
        self._refused: dict[int, int] = {}  # key -> JSON length, of grammars over MAX_GRAMMAR_JSON_CHARS
        self._held: OrderedDict[int, None] = OrderedDict()  # the keys the child holds, least recently used first
        self.grammars_sent = 0  # grammar JSONs that crossed the pipe
        self.on_outputs: Callable[[list[tuple[str, Any]]], None] | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self.error: BaseException | None = None
        self._closing = False
        # Replies (stats, LoRA loads at start-up) come through the reader before any request does.
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def attach(self, on_outputs: Callable[[list[tuple[str, Any]]], None],
               on_death: Callable[[BaseException], None]) -> None:
        """Where step outputs go (called from the reader thread), and whom to tell if the process dies."""
        self.on_outputs, self.on_death = on_outputs, on_death
        if self.error is not None:
            on_death(self.error)

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                error = EngineProcessError(f"engine process exited (code {self._proc.poll()})")
                break
            kind = msg[0]
            if kind == "out":
                assert self.on_outputs is not None
                self.on_outputs(msg[1])
            elif kind == "reply":
                _, call_id, ok, value = msg
                fut = self._calls.pop(call_id, None)
                if fut is not None:
                    fut.set_result(value) if ok else fut.set_exception(value)
            elif kind == "dead":
                error = msg[1]
                break
        if self._closing:
            return
        self.error = error
        for fut in list(self._calls.values()):
            fut.set_exception(error)
        self._calls.clear()
        if self.on_death is not None:
            self.on_death(error)

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._send_locked(msg)

    def _send_locked(self, msg: tuple) -> None:
        try:
            self._conn.send(msg)
        except OSError as exc:  # the child died between two sends (the reader reports it too)
            raise EngineProcessError(f"engine process exited (code {self._proc.poll()})") from exc

    # ---- commands (engine_client.ProcessClient) ----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, lora_slot: int = 0,
                    grammar: Any = None, serialize: bool = True) -> bool:
        """Send the request. Its grammar (an xgrammar CompiledGrammar, which does not pickle) crosses as JSON once
        per grammar object; later requests with the same object (the n choices of a request, the server's
        compiled-grammar cache) name it by key. False, with nothing sent, when the child lacks the grammar and
        serialize is False: serializing a large one takes seconds, which the caller spends off its event loop.
        Raises ValueError (nothing sent) when the grammar's JSON is over MAX_GRAMMAR_JSON_CHARS."""
        add = ("add", request_id, prompt_token_ids, params, lora_slot)
        if grammar is None:
            self._send((*add, None))
            return True
        key = self._grammar_key(grammar)
        if self._send_if_held(add, key):
            return True
        if not serialize:
            return False
        with self._grammar_lock:  # concurrent choices of one grammar wait here, then find it held
            if self._send_if_held(add, key):
                return True
            if not self._tokenizer_info_sent:
                self._send(("tokenizer_info", grammar.tokenizer_info.serialize_json()))
                self._tokenizer_info_sent = True
            grammar_json = self._serialize(grammar, key)
            with self._send_lock:  # what the child holds changes with this send only
                drop = []
                while len(self._held) >= GRAMMARS_HELD:
                    drop.append(self._held.popitem(last=False)[0])
                self._held[key] = None
                self._send_locked((*add, (key, grammar_json, drop)))
            self.grammars_sent += 1
        return True

    def _send_if_held(self, add: tuple, key: int) -> bool:
        with self._send_lock:
            if key not in self._held:
                return False
            self._held.move_to_end(key)
            self._send_locked((*add, (key, None, [])))
        return True

    def _grammar_key(self, grammar: Any) -> int:
        """A key per grammar object, dropped with the object (so a later object at its address gets its own).
        By identity: a CompiledGrammar compares by value and does not hash."""
        with self._keys_lock:
            key = self._grammar_keys.get(id(grammar))
            if key is None:
                key = self._grammar_keys[id(grammar)] = next(self._grammar_ids)
                weakref.finalize(grammar, _forget_grammar, self._grammar_keys, self._refused, id(grammar), key)
        return key

    def _serialize(self, grammar: Any, key: int) -> str:
        size = self._refused.get(key)
        if size is None:
            grammar_json = grammar.serialize_json()
            if len(grammar_json) <= MAX_GRAMMAR_JSON_CHARS:
                return grammar_json
            size = self._refused[key] = len(grammar_json)  # the next request with it is refused without serializing
        raise RequestRefused(f"the guided decoding constraint compiles to a grammar of {size / 2**20:.0f} MiB, over this "
                             f"server's limit of {MAX_GRAMMAR_JSON_CHARS / 2**20:g} MiB: simplify it (fewer "
                             "properties, patterns or alternatives)")  # param: the caller's constraint field

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call(self, method: str, *args: Any, timeout: float | None = 300) -> Any:
        """Run `method` on the child's engine (or its executor: 'executor.<name>') between two steps."""
        if self.error is not None:
            raise self.error
        if self._proc.poll() is not None:  # gone, and the reader has not noticed yet
            raise EngineProcessError(f"engine process exited (code {self._proc.poll()})")
        fut: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._send(("call", call_id, method, args))
        return fut.result(timeout=timeout)

    def shutdown(self) -> None:
        self._closing = True
        if self._proc.poll() is None:
            try:
                self._send(("stop",))
                self._proc.wait(timeout=10)
            except (OSError, EngineProcessError, subprocess.TimeoutExpired):  # died just before (not reaped yet)
                self._proc.kill()
        self._conn.close()


def _forget_grammar(keys: dict[int, int], refused: dict[int, int], object_id: int, key: int) -> None:
    keys.pop(object_id, None)
    refused.pop(key, None)


def _child_main(conn: Connection) -> None:
    """Build the engine from the parent's config, report ready (or the start-up error), then loop."""
    from rayllm.common import startup_phases

    with startup_phases.phase("imports"):
        from rayllm.engine.engine import LLMEngine  # the child's heavy import: torch, the model
    config = conn.recv()
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        conn.send(("error", exc))
        return
    # The parent's EOS ids come once its tokenizer is loaded (in parallel with the load above); the
    # engine's set is theirs plus the model's own, as LLMEngine(config, eos_token_ids) makes it.
    engine.eos_token_ids = engine.eos_token_ids | frozenset(conn.recv())
    conn.send(("ready", {"arch": engine.arch, "max_model_len": engine.max_model_len,
                         "capacity_tokens": engine.capacity_tokens, "startup": engine.startup_phases}))
    try:
        _EngineLoop(conn, engine).run()
    except (EOFError, OSError):  # the serving process is gone
        pass
    finally:
        engine.shutdown()


class _EngineLoop:
    """Drain commands, step while there is work, send each step's outputs; block on the pipe when idle."""

    def __init__(self, conn: Connection, engine) -> None:
        self.conn = conn
        self.engine = engine
        self.tokenizer_info = None  # xgrammar.TokenizerInfo, sent once before the first grammar
        self.grammars: dict[int, Any] = {}  # deserialized grammars by key; the parent bounds it (GRAMMARS_HELD)

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            while conn.poll(0 if engine.has_work() else 1.0):
                if not self.handle(conn.recv()):
                    return
            if not engine.has_work():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                log.exception("engine step failed")
                conn.send(("dead", EngineDeadError(f"engine failed: {exc}")))
                return
            if outputs:
                conn.send(("out", [(o.request_id, o) for o in outputs]))

    def handle(self, msg: tuple) -> bool:
        """One command; False = stop."""
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, lora_slot, grammar_ref = msg
            try:
                grammar = None if grammar_ref is None else self.grammar(*grammar_ref)
                self.engine.add_request(rid, prompt, params, lora_slot, grammar)
            except Exception as exc:  # refused (length, capacity) or failed: that request fails, nothing else
                self.conn.send(("out", [(rid, exc if isinstance(exc, ValueError) else SequenceError(rid, describe(exc)))]))
        elif kind == "abort":
            out = self.engine.abort(msg[1])
            if out is not None:  # the request's last output (finish_reason "abort"), if anyone still reads it
                self.conn.send(("out", [(msg[1], out)]))
        elif kind == "call":
            _, call_id, method, args = msg
            try:
                target: Any = self.engine
                for part in method.split("."):
                    target = getattr(target, part)
                self.conn.send(("reply", call_id, True, target(*args)))
            except Exception as exc:
                self.conn.send(("reply", call_id, False, exc))
        elif kind == "tokenizer_info":
            import xgrammar

            self.tokenizer_info = xgrammar.TokenizerInfo.deserialize_json(msg[1])
        elif kind == "stop":
            return False
        return True

    def grammar(self, key: int, grammar_json: str | None, drop: list[int]) -> Any:
        """The grammar an add names: sent with it (JSON) or held since; the add drops what the parent no longer counts."""
        for old in drop:
            del self.grammars[old]
        if grammar_json is not None:
            import xgrammar

            try:
                self.grammars[key] = xgrammar.CompiledGrammar.deserialize_json(grammar_json, self.tokenizer_info)
            except Exception as exc:  # kept: the parent counts it held, and later adds naming it fail alike
                self.grammars[key] = exc
        grammar = self.grammars[key]
        if isinstance(grammar, Exception):
            raise grammar
        return grammar


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("RAYLLM_ENGINE_LOG_LEVEL", "WARNING"))
    _child_main(Connection(int(sys.argv[1])))
