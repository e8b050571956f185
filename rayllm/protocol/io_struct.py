"""Every message that crosses a deployment or process on the generation path, defined once.

The ingress builds a `GenerateRequest` and sends it to a model replica, which streams back batches of
`GenerationDelta` (one per choice that made progress). Plain dataclasses that Ray pickles: importing this
module pulls in neither torch nor the model replica's code, so the ingress stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from rayllm.schema.sampling_params import GuidedSpec, SamplingParams


@dataclass(frozen=True)
class StopOptions:
    """Text-level stopping and detokenization, applied beside the engine (which only knows token ids)."""

    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"


@dataclass
class GenerateRequest:
    """What the ingress sends for one HTTP request: all prompts, each sampled n times."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stop: StopOptions
    n: int = 1
    echo_texts: list[str] | None = None  # completions echo: prompt text emitted first
    lora: str | None = None  # adapter name (also the Serve multiplexed model id); None = base model
    lora_path: str | None = None  # its PEFT directory, loaded on this replica on first use
    guided: GuidedSpec | None = None  # grammar constraint (structured output, forced tool calls)
    best_of: int | None = None  # completions: sample best_of per prompt, return the n most likely
    trace_id: str = ""  # the HTTP request's X-Request-Id: prefixes engine ids, so aborts and logs carry it
    traceparent: str | None = None  # W3C trace context of the ingress's span when tracing is on (rayllm.serve.tracing)


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobEntry(TypedDict):
    """One token's logprob as the model replica sends it: already chat-shaped (OpenAI's `logprobs.content`)."""

    token: str
    logprob: float | None  # None: the first prompt token (prompt_logprobs), which has no logprob
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ModelInfo(TypedDict):
    """The model replica's `model_info()`: what the ingress validates requests against."""

    max_model_len: int
    capacity_tokens: int
    hidden_size: int


@dataclass
class GenerationDelta:
    """What the model deployment yields per choice per step (in batches: `DeltaBatch`)."""

    index: int  # choice index (completions with several prompts: prompt_i * n + j)
    text: str  # new text since the previous delta (stop strings already handled)
    token_ids: list[int]  # new token ids
    logprobs: list[LogprobEntry] | None  # one per new token
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    matched_stop: str | int | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # cumulative for this choice
    prompt_logprobs: list[LogprobEntry | None] | None = None  # first delta only, echo + logprobs
    prompt_text: str | None = None  # first delta only, completions echo
    hidden_states: list[list[float]] | None = None  # return_hidden_states: one vector per new token
    # Set on a request's first delta only: the serving replica, returned as the `x-replica-id` header.
    replica_id: str | None = None


# One streamed message from the model deployment: whatever all of a request's choices produced since the last.
DeltaBatch = list[GenerationDelta]
