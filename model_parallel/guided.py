"""Grammar-constrained decoding with xgrammar: compile a request's constraint once, then mask each step.

The serving layer turns a request into a `GuidedSpec` (plain data). `GrammarCompiler` compiles it
(cached by spec, off the engine thread) into an xgrammar `CompiledGrammar`; the engine keeps one
`GrammarMatcher` per constrained sequence, fills that sequence's row of allowed-token bits before each
sampled step and advances the matcher with the token drawn. The sampler only sees a bitmask row.

xgrammar is imported lazily: it is needed only once a constrained request arrives.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from model_parallel.sampling_params import GuidedSpec

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; clients need only the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _clean(exc: BaseException) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe, with an LRU cache so repeated schemas are free."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
        self._cache: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def compile(self, spec: GuidedSpec) -> Any:
        """The CompiledGrammar for `spec`; raises ValueError with a client-readable reason."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(_clean(exc)) from None
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GuidedSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_schema":
            # Compact JSON: with free whitespace a small model can loop on newlines until max_tokens.
            return c.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.value)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(spec.value)
        raise ValueError(f"unknown constraint kind {spec.kind!r}")


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def next_token_bitmask(matcher: Any, vocab_size: int) -> torch.Tensor:
    """The matcher's allowed next tokens as int32 words of 32 bits each ([ceil(vocab / 32)])."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]
