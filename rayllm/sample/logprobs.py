"""Prompt logprobs in row slices of bounded size.

A prompt-logprob request needs the logits of every prompt row of its chunk: built at once, a step of 8192
tokens over a 128k vocabulary would take ~10 GB of fp32 logits, more than start-up profiling reserves
(worker.profile_activation_bytes), and an out-of-memory there fails the whole step. So the LM head, the
fp32 upcast, log_softmax, the gather and the top-k run on at most `slice_rows(vocab)` rows at a time, and
only what the response needs (each target's logprob, the top-k values and ids) outlives a slice. After the
LM head each row's math is the one `prompt_logprobs` does on all of a sequence's rows at once; the LM head's
GEMM may round a row's fp32 logits differently for another row count (as it already did for another batch)
unless scheduler.batch_invariant holds it, and then the numbers are the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch

from rayllm.common.errors import describe
from rayllm.sample.sampling_inputs import prompt_logprobs, to_device
from rayllm.schema.outputs import TokenLogprob
from rayllm.schema.step import SeqStep

# fp32 logits of one slice (the upcast and log_softmax each take this much, the model-dtype logits up to
# as much again): 256 MiB is 512 rows of a 128k vocabulary.
PROMPT_LOGPROB_SLICE_BYTES = 256 << 20
# The most top logprobs a request can ask for through the API (chat's top_logprobs): what profiling asks.
PROFILED_TOP_K = 20


def slice_rows(vocab_size: int) -> int:
    """Rows per slice: read at call time, so that a test can lower the bound."""
    return max(1, PROMPT_LOGPROB_SLICE_BYTES // (4 * vocab_size))


def balanced_slices(total: int, most: int) -> list[tuple[int, int]]:
    """[start, end) slices of `total` rows, at most `most` each and of near-equal size: no small last slice,
    which the LM head might run on another path (linear_method.SmallBatchMethod) than the rest."""
    count = -(-total // most)
    bounds = [total * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def profile_one_slice(hidden: torch.Tensor, vocab_size: int,
                      logits_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A full slice's work on the first rows of `hidden`, for start-up memory profiling
    (worker.profile_activation_bytes): the most that prompt logprobs add to a step, whatever its prompts."""
    rows = min(slice_rows(vocab_size), hidden.shape[0])
    prompt_logprobs(logits_of(hidden[:rows]), [0] * rows, PROFILED_TOP_K)


@dataclass
class PromptRows:
    """A sequence's prompt rows in the step's hidden states: [first, first + len(targets))."""

    seq: SeqStep
    first: int


@dataclass
class PromptLogprobs:
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def sliced_prompt_logprobs(hidden: torch.Tensor, seqs: list[PromptRows], vocab_size: int,
                           logits_of: Callable[[torch.Tensor], torch.Tensor], gather: bool,
                           skip: Container[str] = ()) -> PromptLogprobs:
    """Prompt logprobs of `seqs` (top-k as each one's params ask) from their rows of `hidden`.

    Every rank calls this with the same step, so each runs the LM head (a collective under tensor
    parallelism) on the same slices; gather=False (ranks other than the driver) stops there. A sequence
    whose share of a slice fails, or that is in `skip` (failed already), is left out alone.
    """
    out = PromptLogprobs()
    # The step's rows in order, each with its sequence and its index among that one's targets.
    rows = [(p, i) for p in seqs for i in range(len(p.seq.prompt_logprob_targets))]
    for start, end in balanced_slices(len(rows), slice_rows(vocab_size)):
        index = to_device([p.first + i for p, i in rows[start:end]], torch.long, hidden.device)
        logits = logits_of(hidden.index_select(0, index))
        if gather:
            _gather(out, logits, rows[start:end], skip)
        del logits  # freed before the next slice's LM head runs
    return out


def _gather(out: PromptLogprobs, logits: torch.Tensor, rows: list[tuple[PromptRows, int]],
            skip: Container[str]) -> None:
    """Each sequence's run of rows within one slice (`logits`, a row each), appended to what it has."""
    lo = 0
    while lo < len(rows):
        p, i = rows[lo]
        hi = min(len(rows), lo + len(p.seq.prompt_logprob_targets) - i)
        rid = p.seq.request_id
        if p.seq.params is not None and rid not in skip and rid not in out.errors:
            try:
                got = prompt_logprobs(logits[lo:hi], p.seq.prompt_logprob_targets[i : i + hi - lo],
                                      p.seq.params.prompt_logprobs or 0)
                out.logprobs.setdefault(rid, []).extend(got)
            except Exception as exc:  # this sequence's own rows: it fails alone
                out.errors[rid] = describe(exc)
                out.logprobs.pop(rid, None)
        lo = hi
