"""Engine-side sampling parameters: a plain frozen dataclass, no pydantic, no HTTP."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

# What the step can hold: token ids and counts fit int32 tensors, seeds torch's 64 bits, and every float
# stays finite in fp32 arithmetic after scaling, penalties and biases.
_MAX_TOKEN_ID = 2**31 - 1
_SEED_MODULUS = 2**64
_MAX_FLOAT = 1e6
MAX_PRIORITY = 1_000_000  # |priority| bound: keeps priority * aging_steps + step a small int
_MIN_TEMPERATURE = 1e-5
_MIN_REPETITION = 1e-6


def _int(name: str, value: object, lo: int | None, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}],"
                         f" got {value}")
    return int(value)


def _finite(name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a finite number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


GuidedKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class GuidedSpec:
    """What to constrain a request's output to (compiled by guided.GrammarCompiler).

    `param` names the request field, for error messages.
    """

    kind: GuidedKind
    value: str  # JSON schema text, regex, EBNF grammar, or structural-tag JSON
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    """What the engine needs to decide the next token and when to stop.

    Text-level concerns (stop strings, detokenization) live in the serving layer;
    the engine only knows token ids.
    """

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables (normalised to -1, as is anything larger than any vocabulary)
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None  # reduced modulo 2**64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Number of top logprobs to return per generated token; None = no logprobs, 0 = chosen token only.
    logprobs: int | None = None
    # Same for prompt tokens (needed by completions' echo + logprobs).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM: sample only among these (empty: any token)
    # vLLM's bad_words as token sequences: a sequence's last token is banned whenever the output ends with
    # the rest of it (a one-token word: always)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    return_hidden_states: bool = False  # SGLang: the final hidden state behind each output token
    cache_salt: str | None = None  # prefix-cache namespace (tenant, vLLM's cache_salt): see block_manager
    # Scheduling (engine/wait_queue.py): lower is served first, as vLLM's `priority`; read only with
    # scheduler.policy: priority. tenant: the API key's owner, for scheduler.max_running_share.
    priority: int = 0
    tenant: str | None = None
    # A pooling request: prefill only, never sample; the finished output carries the pooled, unit-length
    # final hidden state (`RequestOutput.embedding`; pooling per model: EngineConfig.model.pooling).
    embed: bool = False

    def __post_init__(self) -> None:
        """Refuse (ValueError) or normalise every field to what the step can hold, so no request reaches
        the engine with a value that would raise inside it (an overflowing int, a NaN)."""
        set_ = partial(object.__setattr__, self)
        temperature = _finite("temperature", self.temperature, 0.0, _MAX_FLOAT)
        set_("temperature", 0.0 if temperature < _MIN_TEMPERATURE else temperature)  # vLLM: ~0 means greedy
        set_("top_p", _finite("top_p", self.top_p, 0.0, 1.0))
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1]")
        top_k = _int("top_k", self.top_k, -1, None)
        set_("top_k", -1 if top_k == 0 or top_k > _MAX_TOKEN_ID else top_k)  # larger than any vocabulary: off
        set_("min_p", _finite("min_p", self.min_p, 0.0, 1.0))
        set_("priority", _int("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY))
        set_("max_tokens", _int("max_tokens", self.max_tokens, 1, _MAX_TOKEN_ID))
        set_("min_tokens", _int("min_tokens", self.min_tokens, 0, self.max_tokens))
        if self.seed is not None:  # torch seeds are 64-bit; per-choice seeds (seed + i) wrap the same way
            set_("seed", _int("seed", self.seed, None, None) % _SEED_MODULUS)
        set_("stop_token_ids", tuple(_int("stop_token_ids", t, 0, _MAX_TOKEN_ID) for t in self.stop_token_ids))
        set_("allowed_token_ids", tuple(sorted({_int("allowed_token_ids", t, 0, _MAX_TOKEN_ID)
                                                for t in self.allowed_token_ids})))
        words = tuple(tuple(_int("bad_words", t, 0, _MAX_TOKEN_ID) for t in w) for w in self.bad_words_token_ids)
        if any(not w for w in words):
            raise ValueError("bad_words: a word must have at least one token")
        set_("bad_words_token_ids", tuple(dict.fromkeys(words)))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                set_(name, _int(name, getattr(self, name), 0, _MAX_TOKEN_ID))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, _finite(name, getattr(self, name), -_MAX_FLOAT, _MAX_FLOAT))
        set_("repetition_penalty", _finite("repetition_penalty", self.repetition_penalty, _MIN_REPETITION, _MAX_FLOAT))
        set_("logit_bias", tuple((_int("logit_bias", tok, 0, _MAX_TOKEN_ID), _finite("logit_bias", bias, -_MAX_FLOAT,
                                                                                     _MAX_FLOAT))
                                 for tok, bias in self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )
