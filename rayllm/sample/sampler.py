"""Batched sampling with per-request parameters: pure functions over logits. Runs on rank 0 only.

Order, as in vLLM: logit bias and min-token masking, penalties, temperature, then min_p / top_k /
top_p truncation, then a draw. Reported logprobs are of the distribution after penalties and
temperature (before truncation). Seeded requests draw from their own generator, so their tokens
do not depend on what else is in the batch.

Every tensor here lives on the logits' device (sampling_inputs builds them there), and the device
work (`sample_on_device`) never reads a value back to the host: the only synchronisation is the
final copy of the chosen ids and logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rayllm.schema.outputs import TokenLogprob

# The id a row whose masks exclude every token samples (sample_on_device); its request fails alone.
NO_TOKEN = -1


@dataclass
class Penalties:
    """Presence / frequency / repetition penalties of a batch, as [B] factors and [B, V] token statistics
    (rows without penalties have presence 0, frequency 0, repetition 1, which leave them unchanged)."""

    seen: torch.Tensor  # [B, V] bool: the token occurs in the row's prompt or output
    counts: torch.Tensor  # [B, V] float: occurrences in the row's output
    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float, 0 = greedy
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] long, vocab size = disabled
    min_ps: torch.Tensor  # [B]
    generators: list[torch.Generator | None]  # per row; None = the device's default generator
    all_greedy: bool
    needs_truncation: bool
    max_logprobs: int | None  # largest top-k logprobs asked in the batch (<= vocab); None = none asked
    needs_min_p: bool = False
    # Optional extras (None when no row asks for them).
    additive: torch.Tensor | None = None  # [B, V] logit bias, -inf masks (min_tokens, grammar)
    penalties: Penalties | None = None


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (divide positive logits, multiply negative ones, for every token seen), then
    frequency and presence (subtracted per output occurrence / once); batched, fixed shapes."""
    rep = p.repetition.unsqueeze(1)
    logits = torch.where(p.seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency.unsqueeze(1) * p.counts - p.presence.unsqueeze(1) * (p.counts > 0).to(logits.dtype)


def _truncate(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    probs = logits.softmax(-1)
    if t.needs_min_p:
        keep = probs >= t.min_ps.unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(keep.logical_not(), float("-inf"))
        probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = ranks >= t.top_ks.unsqueeze(1)
    # top_p over what top_k left (renormalised), as transformers and vLLM apply them one after the other:
    # keep the smallest prefix whose mass reaches top_p. The most likely token always stays (top_p
    # rounds to 0 in fp32 for tiny values, which would otherwise drop every token).
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    top_p = t.top_ps.unsqueeze(1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # (top_p < 1: rounding in the cumulative sum must not cut the tail of rows that ask for no top_p.)
    drop = drop | ((mass_before >= top_p * sorted_probs.sum(-1, keepdim=True)) & (ranks > 0) & (top_p < 1))
    drop_unsorted = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_unsorted, float("-inf"))


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """fp32 logits after logit bias, -inf masks (min_tokens, grammar) and penalties."""
    logits = logits.float()
    if t.additive is not None:
        logits = logits + t.additive
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    return logits


def scaled_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Processed logits over each row's temperature (greedy rows: unscaled): what logprobs report."""
    temps = torch.where(t.temperatures == 0, torch.ones_like(t.temperatures), t.temperatures)
    return logits / temps.unsqueeze(1)


def sampling_probs(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distribution each row draws from: softmax of its scaled logits after min_p, top_k and top_p."""
    return (_truncate(scaled, t) if t.needs_truncation else scaled).softmax(-1)


def sample_on_device(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [B, V]. Returns the chosen ids [B] and, when logprobs are asked, the log-softmax [B, V] of
    the distribution they are reported from; both on the logits' device."""
    logits = processed_logits(logits, t)
    # Masks can leave a row no token (allowed_token_ids less the stop tokens min_tokens holds back, or less
    # bad_words): it picks NO_TOKEN, which the caller fails alone, rather than token 0 from NaNs (no sync here).
    dead = torch.isneginf(logits).all(-1) if t.additive is not None else None
    if t.all_greedy and t.max_logprobs is None:
        return _or_no_token(logits.argmax(-1), dead), None
    scaled = scaled_logits(logits, t)
    if t.all_greedy:
        chosen = logits.argmax(-1)
    else:
        probs = sampling_probs(scaled, t)
        # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1); each seeded row uses its own stream.
        noise = torch.empty_like(probs).exponential_()
        for i, g in enumerate(t.generators):
            if g is not None:
                noise.select(0, i).exponential_(generator=g)
        chosen = (probs / noise).argmax(-1)
        chosen = torch.where(t.temperatures == 0, logits.argmax(-1), chosen)
    return _or_no_token(chosen, dead), (scaled.log_softmax(-1) if t.max_logprobs is not None else None)


def _or_no_token(chosen: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
    return chosen if dead is None else chosen.masked_fill(dead, NO_TOKEN)


def greedy(logits: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
    """Each row's argmax, for a batch without bias, masks, penalties or logprobs (the common case).
    argmax: a kernel that reads bf16 logits directly (cpu_kernels); torch's argmax over fp32 is ~3x
    faster than over bf16 (vectorized), and exact."""
    if argmax is not None and logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
        return argmax(logits).tolist()
    return logits.float().argmax(-1).tolist()


def sample(logits: torch.Tensor, t: SamplingTensors,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprob] | None]:
    """logits: [B, V] in the model dtype. Returns chosen token ids and, if asked, their logprobs.
    argmax: for the all-greedy fast path (`greedy`)."""
    if t.all_greedy and t.max_logprobs is None and t.additive is None and t.penalties is None:
        return greedy(logits, argmax), None
    chosen, logprobs = sample_on_device(logits, t)
    if logprobs is None or t.max_logprobs is None:
        return chosen.tolist(), None
    return chosen.tolist(), gather_logprobs(logprobs, chosen.clamp_min(0), t.max_logprobs)  # NO_TOKEN rows fail


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """On the device: each chosen token's logprob [R] and, for k > 0, the top-k values and ids [R, k]."""
    picked = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    if k <= 0:
        return picked, None, None
    vals, idx = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return picked, vals, idx


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    picked_t, vals_t, idx_t = top_logprobs(logprobs, chosen, k)
    picked = picked_t.tolist()
    top_vals: list[list[float]] = vals_t.tolist() if vals_t is not None else [[] for _ in picked]
    top_ids: list[list[int]] = idx_t.tolist() if idx_t is not None else [[] for _ in picked]
    chosen_ids = chosen.tolist()
    return [
        TokenLogprob(chosen_ids[i], picked[i], list(zip(top_ids[i], top_vals[i], strict=True)))
        for i in range(len(picked))
    ]
