"""Grammar-constrained decoding with xgrammar: compile a request's constraint once, then mask each step.

The serving layer turns a request into a `GuidedSpec` (plain data). `GrammarCompiler` compiles it
(cached by spec, off the engine thread; in the server, in a child process with a time limit) into an
xgrammar `CompiledGrammar`; the engine keeps one `GrammarMatcher` per constrained sequence, fills that sequence's row of allowed-token bits before each
sampled step and advances the matcher with the token drawn. The sampler only sees a bitmask row.

xgrammar is imported lazily: it is needed only once a constrained request arrives.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from rayllm.sample.grammar_worker import CompilerBusy, CompileTimeout, CompileWorker, compile_spec
from rayllm.schema.sampling_params import GuidedSpec

if TYPE_CHECKING:  # the serving side (the model replica) never needs torch itself
    import torch

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; clients need only the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe, with an LRU cache (bounded in bytes) so repeated
    schemas are free.

    timeout_s: compile in a child process (grammar_worker) and give up after this long (ValueError
    saying so; the child is killed); None compiles in the calling thread (tests, benchmarks).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_bytes: int = 256 << 20, timeout_s: float | None = None):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._worker = None
        if timeout_s is not None:
            self._worker = CompileWorker(self._info, timeout_s)
        self.timeout_s = timeout_s
        self._cache: OrderedDict[GuidedSpec, tuple[Any, int]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._pending: dict[GuidedSpec, Future] = {}  # specs being compiled -> their outcome
        self.num_compiled = 0  # cache misses, for tests and metrics

    def compile(self, spec: GuidedSpec) -> Any:
        """The CompiledGrammar for `spec`; raises ValueError with a client-readable reason. Concurrent calls
        for a spec being compiled wait for that compile and share its result or error (a burst of requests
        with one new schema compiles it once, not once per request in the compiler's queue)."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec][0]
            pending = self._pending.get(spec)
            if pending is None:
                self._pending[spec] = mine = Future()
        if pending is not None:
            return pending.result()
        try:
            compiled = self._compile_cached(spec)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        else:
            mine.set_result(compiled)
            return compiled
        finally:
            with self._lock:
                del self._pending[spec]

    def _compile_cached(self, spec: GuidedSpec) -> Any:
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(_clean(exc)) from None
        size = int(getattr(compiled, "memory_size_bytes", 0)) + len(spec.value)
        with self._lock:
            self.num_compiled += 1
            if spec not in self._cache and size <= self._cache_bytes:
                self._cache[spec] = (compiled, size)
                self.cached_bytes += size
            while self.cached_bytes > self._cache_bytes:
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped
        return compiled

    def _compile(self, spec: GuidedSpec) -> Any:
        if self._worker is None:
            return compile_spec(self._compiler, spec)
        try:
            return self._worker.compile(spec)
        except CompileTimeout:
            raise ValueError(f"compiling it took more than this server's limit of {self.timeout_s:g} s of CPU time") from None
        except CompilerBusy:
            raise CompilerBusyError("the grammar compiler is busy with other requests; retry the request") from None

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


class CompilerBusyError(Exception):
    """Other compiles held the compiler past this one's time limit (a 503, not the client's fault)."""


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def next_token_bitmask(matcher: Any, vocab_size: int) -> torch.Tensor:
    """The matcher's allowed next tokens as int32 words of 32 bits each ([ceil(vocab / 32)])."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]
