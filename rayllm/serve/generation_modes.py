"""Request shapes the model deployment answers from several engine requests: `best_of` (candidates ranked
by cumulative logprob) and literal choices (each scored by its canonical tokens, then picked)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerateRequest, GenerationDelta, LogprobEntry, StopOptions
from rayllm.protocol.structured import pick_choice

if TYPE_CHECKING:  # the ingress imports this module's bounds without the tokenizer
    from rayllm.serve.tokenizer import TokenizerService


class Generator(Protocol):
    """What these modes need of the model deployment (LLMServer): its tokenizer and its own generate."""

    tokenizer: TokenizerService

    def generate(self, req: GenerateRequest) -> AsyncIterator[list[GenerationDelta]]: ...


async def best_of(server: Generator, req: GenerateRequest) -> list[GenerationDelta]:
    """best_of candidates per prompt, ranked by cumulative logprob; the top n come back as choices 0..n-1.

    Usage counts every candidate (they were all generated): the dropped ones' tokens are added to
    each prompt's first kept choice.
    """
    logprobs = req.params.logprobs
    wide = replace(req, n=req.best_of, best_of=None,
                   params=replace(req.params, logprobs=0 if logprobs is None else logprobs))
    per_choice: dict[int, list[GenerationDelta]] = {}
    async for batch in server.generate(wide):
        for d in batch:
            per_choice.setdefault(d.index, []).append(d)
    assert req.best_of is not None
    out: list[GenerationDelta] = []
    for p in range(len(req.prompts)):
        candidates = [per_choice.get(p * req.best_of + j, []) for j in range(req.best_of)]
        scores = [sum(e["logprob"] for d in c for e in d.logprobs or []) for c in candidates]
        order = sorted(range(req.best_of), key=lambda j: scores[j], reverse=True)
        dropped = sum(candidates[j][-1].completion_tokens for j in order[req.n:] if candidates[j])
        for rank, j in enumerate(order[: req.n]):
            for d in candidates[j]:
                d.index = p * req.n + rank
                d.completion_tokens += dropped if rank == 0 else 0
                if logprobs is None:
                    d.logprobs = None
                out.append(d)
    return out


# Scoring prefills each prompt once a literal (prompt logprobs skip the prefix cache): past this many tokens in
# all, or this many sequences (prompts x choices, which the ingress counts against max_sequences_per_request),
# the constraint is sampled under its grammar instead (one sequence a choice, cache shared).
MAX_SCORING_TOKENS = 1 << 16
MAX_SCORED_SEQUENCES = 64


def scoring_fits(req: GenerateRequest, choices: list[str]) -> bool:
    """Whether literal choices are scored (choose); else they are sampled under their grammar, which applies
    the controls scoring ignores: logit_bias, bad_words, allowed_token_ids, penalties, min_tokens, stops,
    hidden states."""
    p, stop = req.params, req.stop
    if (p.logit_bias or p.bad_words_token_ids or p.allowed_token_ids or p.presence_penalty or p.frequency_penalty
            or p.repetition_penalty != 1.0 or p.min_tokens or p.stop_token_ids or p.return_hidden_states
            or stop.stop or stop.stop_regex):
        return False
    if len(req.prompts) * len(choices) > MAX_SCORED_SEQUENCES:
        return False
    # A choice's tokens are at most its UTF-8 bytes (byte-level and byte-fallback vocabularies), plus a
    # leading-space piece and the end token it may be scored with.
    choice_tokens = sum(len(c.encode()) + 2 for c in choices)
    return len(choices) * sum(len(q) for q in req.prompts) + len(req.prompts) * choice_tokens <= MAX_SCORING_TOKENS


def end_token(tokenizer: TokenizerService) -> int | None:
    """The token generation ends a choice with: the model's configured EOS (a chat model's end of turn) when
    it stops generation, else the first id that does."""
    eos = tokenizer.tokenizer.eos_token_id
    return eos if eos in tokenizer.eos_token_ids else next(iter(tokenizer.eos_token_ids), None)


def token_prefix(ids: list[int], canon: list[list[int]]) -> bool:
    return any(len(o) > len(ids) and o[: len(ids)] == ids for o in canon)


def scored(delta: GenerationDelta, prompt_len: int, choice_len: int) -> list[LogprobEntry]:
    """A choice's logprob entries after the prompt. Missing ones fail the request: a choice scored 0 (the
    best possible score) would be picked whatever the model thinks of it."""
    rest = [e for e in (delta.prompt_logprobs or [])[prompt_len:] if e is not None]
    if len(rest) != choice_len:
        raise APIError(500, f"scoring a guided choice returned {len(rest)} logprobs for its {choice_len} tokens",
                       code="choice_scoring_failed")
    return rest


async def choose(server: Generator, req: GenerateRequest, choices: list[str]) -> list[GenerationDelta]:
    """Literals: each scored by the raw model's logprob of its canonical tokens after the prompt (one prefill
    each, batched), then picked (pick_choice); a grammar would let sampling spell it in any tokenization.

    A choice whose tokens begin another choice (the empty one begins them all) is scored with the end token
    after it: under the grammar the model either ends there or goes on to the longer choice, and the end's
    probability decides; scored by its own tokens alone, the shorter always scored at least as high."""
    canon = [server.tokenizer.encode(c, add_special_tokens=False) for c in choices]
    end = end_token(server.tokenizer)
    ended = [ids + [end] if end is not None and token_prefix(ids, canon) else ids for ids in canon]
    top = req.params.logprobs
    # The request's own params (tenant, priority, cache_salt): scoring counts in its tenant's share and queue.
    scoring = replace(req.params, temperature=0, max_tokens=1, prompt_logprobs=top or 0, logprobs=None)
    wide = replace(req, prompts=[p + c for p in req.prompts for c in ended], n=1, guided=None, best_of=None,
                   params=scoring, stop=StopOptions(), echo_texts=None)
    first: dict[int, GenerationDelta] = {}
    async for batch in server.generate(wide):
        for d in batch:
            first.setdefault(d.index, d)
    out: list[GenerationDelta] = []
    for p, prompt in enumerate(req.prompts):
        entries = [scored(first[p * len(canon) + k], len(prompt), len(ended[k])) for k in range(len(canon))]
        scores = [sum(e["logprob"] for e in lps) for lps in entries]
        for j in range(req.n):
            k = pick_choice(scores, req.params.temperature, None if req.params.seed is None else req.params.seed + j)
            ids = canon[k][: req.params.max_tokens]
            full = len(ids) == len(canon[k])
            out.append(GenerationDelta(
                index=p * req.n + j, text=choices[k] if full else server.tokenizer.decode(ids), token_ids=ids,
                logprobs=entries[k][: len(ids)] if top is not None else None,
                finish_reason="stop" if full else "length", matched_stop=None,
                prompt_tokens=len(prompt), cached_tokens=0, completion_tokens=len(ids),
                prompt_text=req.echo_texts[p] if req.echo_texts is not None else None))
    return out
