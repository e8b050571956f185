"""Engine-side sampling parameters: a plain frozen dataclass, no pydantic, no HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
    top_k: int = -1  # -1 or 0 disables
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
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
    return_hidden_states: bool = False  # SGLang: the final hidden state behind each output token
    cache_salt: str | None = None  # prefix-cache namespace (tenant, vLLM's cache_salt): see block_manager

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")

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
