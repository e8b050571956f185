"""What the engine hands back per request per step: plain data, cheap to pickle across Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class TokenLogprob:
    """Logprob of one chosen token plus the top alternatives, as (token_id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class EngineTimings(NamedTuple):
    """A request's way through the engine, in time.time_ns() (0: not reached): on its last output only,
    where the model replica turns them into trace spans (rayllm.serve.tracing_spans)."""

    arrival_ns: int
    scheduled_ns: int  # first scheduled: the end of its queue wait
    first_token_ns: int  # its prefill's end
    finished_ns: int


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # The token id that triggered a "stop" finish (EOS or one of stop_token_ids), if any.
    stop_token_id: int | None = None
    logprobs: list[TokenLogprob] | None = None
    # Only on the first output of a request that asked for prompt_logprobs; first entry is None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Final-layer hidden state (after the last norm) behind each new token, when asked for.
    hidden_states: list[list[float]] | None = None
    # A pooling request's (SamplingParams.embed) unit-length pooled hidden state, on its finished output.
    embedding: list[float] | None = None
    # Set when this request failed on its own (finish_reason "abort"); the engine serves the others on.
    error: str | None = None
    timings: EngineTimings | None = None  # on the finished output


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a step failed in the model or a collective): every request fails."""


# A request whose own parameters mask every token of a step fails with this (a 400 to its client).
NO_TOKEN_LEFT = ("no token is left to sample: allowed_token_ids, bad_words, the stop tokens min_tokens holds back "
                 "and the output constraint exclude every token")


class SequenceError(ValueError):
    """One request failed inside the engine (its sampling inputs, grammar, adapter or parameters) and
    was aborted; the engine goes on serving the others. A ValueError: the request's own inputs led there."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id

    def __reduce__(self) -> tuple:  # crosses the engine process's pipe: both arguments, not just args
        return SequenceError, (self.request_id, str(self))


class RequestRefused(ValueError):
    """The engine will not take a request as sent (too long for the context or the cache, a constraint too
    large): a 400 naming `param`, the request field to change (None: the caller knows it better)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:  # crosses the engine process's pipe with its field
        return RequestRefused, (str(self), self.param)


class StepOutOfMemory(RuntimeError):
    """The device ran out of memory inside a step (torch.OutOfMemoryError in a worker, its cached blocks
    given back): the engine fails that step's requests and serves on."""


@dataclass
class EngineStats:
    """The engine's gauges (LLMEngine.stats). Defined here, torch-free: an engine child process pickles them
    to the model replica, whose unpickling would otherwise import the engine module, and torch with it."""

    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    num_steps: int
    step_seconds: float  # total time spent in step(), for the per-step cost under load
    execute_seconds: float  # of which in the model (executor.execute)
    # The GPU this process's engine steps on, as the driver names it (nvidia-smi's `GPU-...` UUID), and the bytes
    # torch's allocator holds there: placement checks that need no process table ("" and 0 on CPU, and where
    # the ranks run in their own actors).
    device_uuid: str = ""
    device_reserved_bytes: int = 0
