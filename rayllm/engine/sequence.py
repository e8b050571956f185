"""A request's state inside the engine: token ids, progress, block table. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rayllm.schema.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: queues find and remove a sequence by itself, never by comparing fields
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    lora_slot: int = 0  # 0 = base model
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in the cache (computed or reused from the prefix cache).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first scheduling (reported to the user).
    num_cached_tokens: int = -1
    block_table: list[int] = field(default_factory=list)
    # Chain digests of the leading full blocks already registered in the prefix cache.
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    prompt_logprobs: list = field(default_factory=list)  # accumulated over prefill chunks
    prompt_logprobs_sent: bool = False
    matcher: Any = None  # xgrammar GrammarMatcher of a constrained request (see guided.py)
    pooling: str | None = None  # a pooling request's "last" | "mean" (never samples)
    pool_sum: list[float] | None = None  # mean pooling: the sum of the rows computed so far
    penalty_synced: int = 0  # leading tokens the driver's penalty state holds (SeqStep.history_start)
    rank: tuple[int, int] | None = None  # its place in the wait queue's order, set when first queued
    # time.time_ns() of its arrival, first scheduling and first token (schema.outputs.EngineTimings)
    arrival_ns: int = 0
    scheduled_ns: int = 0
    first_token_ns: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
