"""What the engine sends each worker per step, and what the driver rank sends back: the same messages go to
every rank (in process or over Ray), so they are plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayllm.schema.outputs import TokenLogprob
from rayllm.schema.sampling_params import SamplingParams


@dataclass
class SeqStep:
    """One sequence's share of a step; the same message goes to every rank."""

    request_id: str
    token_ids: list[int]  # tokens to compute now
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the sequence: draw a token
    params: SamplingParams | None = None  # set when sample or prompt logprobs are needed
    # Only when penalties apply: the tokens that the driver's penalty state (sample/penalty_state.py) lacks,
    # from position history_start on; 0 (the first sample, the first after a preemption) rebuilds it from all.
    history: list[int] | None = None
    history_start: int = 0
    num_prompt_tokens: int = 0
    mask_token_ids: tuple[int, ...] = ()  # banned now (EOS/stop ids while below min_tokens)
    # Prompt tokens predicted by this chunk's rows, when prompt logprobs are asked for.
    prompt_logprob_targets: list[int] = field(default_factory=list)
    lora_slot: int = 0
    # Grammar-constrained sequences: the allowed next tokens as 32-bit words (see guided.py).
    allowed_bitmask: Any = None  # a torch tensor of int32 words; typed loosely so the engine core needs no torch
    # Pooling sequences: "last" on the chunk that ends the prompt (its last row), "mean" on every chunk
    # (the sum of its rows; the engine divides).
    pool: str | None = None


@dataclass
class StepInput:
    seqs: list[SeqStep]  # decode sequences (one token) first, then prefill chunks
    finished_request_ids: list[str] = field(default_factory=list)
    # Preempted since the previous step: the driver drops their penalty state (their history_start is 0 again).
    preempted_request_ids: list[str] = field(default_factory=list)


@dataclass
class StepOutput:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    # Logprobs of the prompt tokens that this chunk's rows predict.
    prompt_logprobs: dict[str, list[TokenLogprob]]
    hidden_states: dict[str, list[float]] = field(default_factory=dict)
    # Sequences that failed on their own (their sampling inputs, their adapter): request id -> reason.
    errors: dict[str, str] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # see SeqStep.pool
