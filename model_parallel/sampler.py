"""Batched sampling with per-request parameters: pure functions over logits. Runs on rank 0 only.

Order, as in vLLM: logit bias and min-token masking, penalties, temperature, then min_p / top_k /
top_p truncation, then a draw. Reported logprobs are of the distribution after penalties and
temperature (before truncation). Seeded requests draw from their own generator, so their tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_parallel.outputs import TokenLogprob


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float, 0 = greedy
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] long, vocab size = disabled
    min_ps: torch.Tensor  # [B]
    generators: list[torch.Generator | None]  # per row; None = the shared generator
    all_greedy: bool
    needs_truncation: bool
    max_logprobs: int | None  # largest top-k logprobs asked in the batch; None = none asked
    # Optional extras (None when no row asks for them).
    additive: torch.Tensor | None = None  # [B, V] logit bias and -inf masks (min_tokens)
    penalty_rows: list[tuple[int, list[int], int, float, float, float]] | None = None


def apply_penalties(logits: torch.Tensor, rows: list[tuple[int, list[int], int, float, float, float]]) -> None:
    """rows: (row, history, num_prompt_tokens, presence, frequency, repetition); in place."""
    vocab = logits.shape[1]
    for row, history, num_prompt, presence, frequency, repetition in rows:
        ids = torch.tensor(history, dtype=torch.long)
        if repetition != 1.0:
            seen = torch.unique(ids)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / repetition, vals * repetition)
        out = ids[num_prompt:]
        if out.numel() and (presence or frequency):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def _truncate(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    probs = logits.softmax(-1)
    if bool((t.min_ps > 0).any()):
        keep = probs >= t.min_ps.unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
        probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    ranks = torch.arange(logits.shape[1]).unsqueeze(0)
    drop = ranks >= t.top_ks.unsqueeze(1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= t.top_ps.unsqueeze(1)
    drop_unsorted = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_unsorted, float("-inf"))


def sample(logits: torch.Tensor, t: SamplingTensors,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprob] | None]:
    """logits: [B, V] in the model dtype. Returns chosen token ids and, if asked, their logprobs.
    argmax: a kernel that reads bf16 logits directly (cpu_kernels), for the all-greedy fast path."""
    if t.all_greedy and t.max_logprobs is None and t.additive is None and not t.penalty_rows:
        # The common fast path. torch's argmax over fp32 is ~3x faster than over bf16 (vectorized), and exact.
        if argmax is not None and logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
            return argmax(logits).tolist(), None
        return logits.float().argmax(-1).tolist(), None
    logits = logits.float()
    if t.additive is not None:
        logits = logits + t.additive
    if t.penalty_rows:
        logits = logits.clone()
        apply_penalties(logits, t.penalty_rows)
    if t.all_greedy and t.max_logprobs is None:
        return logits.argmax(-1).tolist(), None

    greedy_rows = t.temperatures == 0
    temps = torch.where(greedy_rows, torch.ones_like(t.temperatures), t.temperatures)
    scaled = logits / temps.unsqueeze(1)
    if t.all_greedy:
        chosen = logits.argmax(-1)
    else:
        candidates = _truncate(scaled, t) if t.needs_truncation else scaled
        probs = candidates.softmax(-1)
        # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1); each seeded row uses its own stream.
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(t.generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_()
        for i, g in enumerate(t.generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        chosen = (probs / noise).argmax(-1)
        chosen = torch.where(greedy_rows, logits.argmax(-1), chosen)
    ids = chosen.tolist()
    if t.max_logprobs is None:
        return ids, None
    return ids, gather_logprobs(scaled.log_softmax(-1), chosen, t.max_logprobs)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in picked]
    top_ids: list[list[int]] = [[] for _ in picked]
    if k > 0:
        vals, idx = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), idx.tolist()
    chosen_ids = chosen.tolist()
    return [
        TokenLogprob(chosen_ids[i], picked[i], list(zip(top_ids[i], top_vals[i], strict=True)))
        for i in range(len(picked))
    ]
