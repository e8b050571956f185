"""A step's sampling inputs: each sampled sequence's parameters become tensors on the logits' device,
and a fault in one sequence's share (its generator, grammar bitmask, bias, or the sampler on its row)
fails that sequence only, reported in `errors`, while the others are sampled as if it were not there.

On CUDA, host-built values go through pinned memory with non-blocking copies, seeded generators are
created on the device, and grammar bitmasks are expanded to masks on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rayllm.common.errors import describe
from rayllm.sample.penalty_state import PenaltyState, PenaltyUpdate
from rayllm.sample.sampler import NO_TOKEN, Penalties, SamplingTensors, gather_logprobs, greedy, sample
from rayllm.schema.outputs import NO_TOKEN_LEFT, TokenLogprob
from rayllm.schema.sampling_params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from rayllm.schema.step import SeqStep


def pin(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and copied without a host wait when it is a GPU."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = pin(t)
    return t.to(device, non_blocking=True)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def new_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's own random stream, on the device that draws from it."""
    return torch.Generator(device=device).manual_seed(seed)


def allowed_tokens(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, vocab_size] bool (bit j of word i allows token 32 * i + j), on their device.
    Model rows past the tokenizer's vocabulary are never allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmasks.device)
    bits = ((bitmasks.unsqueeze(-1) >> shifts) & 1).reshape(bitmasks.shape[0], -1)
    bits = bits.narrow(1, 0, min(vocab_size, bits.shape[1])).bool()
    if bits.shape[1] < vocab_size:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], vocab_size - bits.shape[1])], dim=1)
    return bits


@dataclass
class SamplingRow:
    """One sampled sequence's share of the step, checked on the host (raising here is its own fault)."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None
    bias: list[tuple[int, float]]  # (token, additive), logit_bias first, then -inf masks (min_tokens)
    bitmask: torch.Tensor | None  # [W] int32 from the grammar matcher
    penalty: PenaltyUpdate | None  # the tokens its penalty state gains this step; None: no penalties


@dataclass
class SampleResult:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class SamplingInputs:
    """Per-request state (seeded generators, penalty state) and the batch sampling of one step, fault-isolated."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.generators: dict[str, torch.Generator] = {}
        self.allowed: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}  # allowed_token_ids as bitmask words
        self.penalty = PenaltyState(vocab_size)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)
            self.allowed.pop(rid, None)
        self.penalty.forget(request_ids)

    def preempted(self, request_ids: list[str]) -> None:
        """Preempted sequences give up their penalty state (rebuilt from their whole history when they
        sample again); their seeded streams go on where they were."""
        self.penalty.forget(request_ids)

    def _allowed_words(self, request_id: str, ids: tuple[int, ...]) -> torch.Tensor:
        """allowed_token_ids as [W] int32 words in the grammar bitmask's layout (built once per request)."""
        cached = self.allowed.get(request_id)
        if cached is None or cached[0] != ids:  # (a TP rank gets the params unpickled: equal, not the same)
            v = self.vocab_size
            toks = torch.tensor([t for t in ids if t < v], dtype=torch.long)
            words = torch.zeros(-(-v // 32), dtype=torch.long)
            words.index_add_(0, toks // 32, torch.ones_like(toks) << (toks % 32))  # ids are unique: bits add
            cached = self.allowed[request_id] = (ids, words.to(torch.int32))  # bit 31 wraps to the sign bit
        return cached[1]

    def row(self, s: SeqStep, device: torch.device) -> SamplingRow:
        p = s.params or SamplingParams()
        v = self.vocab_size
        g = None
        if p.seed is not None and not p.greedy:
            g = self.generators.get(s.request_id)
            if g is None:
                g = self.generators[s.request_id] = new_generator(p.seed, device)
        bias = [(tok, b) for tok, b in p.logit_bias if 0 <= tok < v]
        bias += [(tok, float("-inf")) for tok in s.mask_token_ids if 0 <= tok < v]
        bitmask = s.allowed_bitmask
        if bitmask is not None:
            words = -(-v // 32)
            if bitmask.dim() != 1 or bitmask.dtype != torch.int32 or bitmask.shape[0] < words:
                raise ValueError(f"grammar bitmask of shape {tuple(bitmask.shape)} ({bitmask.dtype}) does not "
                                 f"cover {v} tokens")
            bitmask = bitmask[:words]
        if p.allowed_token_ids:  # with a grammar: the tokens both allow
            allowed = self._allowed_words(s.request_id, p.allowed_token_ids)
            if bitmask is not None:
                bitmask = bitmask & allowed
                if not bool(bitmask.any()):  # this request's own fault: it alone fails, with the reason
                    raise ValueError(NO_TOKEN_LEFT)
            else:
                bitmask = allowed
        penalty = None
        if s.history is not None:
            penalty = PenaltyUpdate(s.request_id, s.history_start, s.history, s.num_prompt_tokens)
            self.penalty.check(penalty)
        return SamplingRow(s.request_id, p, g, bias, bitmask, penalty)

    def tensors(self, rows: list[SamplingRow], device: torch.device) -> SamplingTensors:
        params = [r.params for r in rows]
        v = self.vocab_size
        f32 = torch.float32
        additive = None
        if any(r.bias or r.bitmask is not None for r in rows):
            additive = torch.zeros(len(rows), v, dtype=f32, device=device)
            at = [(i, tok, b) for i, r in enumerate(rows) for tok, b in r.bias]
            if at:
                rows_i, toks, vals = zip(*at, strict=True)
                index = (to_device(list(rows_i), torch.long, device), to_device(list(toks), torch.long, device))
                additive.index_put_(index, to_device(list(vals), f32, device), accumulate=True)
            masked = [i for i, r in enumerate(rows) if r.bitmask is not None]
            if masked:
                words = host_to_device(torch.stack([rows[i].bitmask for i in masked]), device)  # type: ignore[misc]
                allowed = allowed_tokens(words, v)
                if len(masked) < len(rows):  # rows without a grammar allow everything
                    allowed = torch.ones(len(rows), v, dtype=torch.bool, device=device).index_copy_(
                        0, to_device(masked, torch.long, device), allowed)
                additive.masked_fill_(allowed.logical_not(), float("-inf"))
        penalties = self._penalties(rows, device) if any(r.penalty is not None for r in rows) else None
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingTensors(
            temperatures=to_device([p.temperature for p in params], f32, device),
            top_ps=to_device([p.top_p for p in params], f32, device),
            top_ks=to_device([p.top_k if 0 < p.top_k < v else v for p in params], torch.long, device),
            min_ps=to_device([p.min_p for p in params], f32, device),
            generators=[r.generator for r in rows],
            all_greedy=all(p.greedy for p in params),
            needs_truncation=any(p.top_p < 1 or 0 < p.top_k < v or p.min_p > 0 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
            max_logprobs=min(max(logprob_counts), v) if logprob_counts else None,
            additive=additive,
            penalties=penalties,
        )

    def _penalties(self, rows: list[SamplingRow], device: torch.device) -> Penalties:
        """Token statistics of the penalised rows from the penalty state, once it has the step's new tokens."""
        self.penalty.update([r.penalty for r in rows if r.penalty is not None], device, to_device)
        seen, counts = self.penalty.rows([r.request_id if r.penalty is not None else None for r in rows], device,
                                         to_device)
        penalised = [r.penalty is not None for r in rows]
        p = [r.params for r in rows]
        f32 = torch.float32
        return Penalties(
            seen=seen, counts=counts,
            presence=to_device([q.presence_penalty if on else 0.0 for q, on in zip(p, penalised, strict=True)], f32, device),
            frequency=to_device([q.frequency_penalty if on else 0.0 for q, on in zip(p, penalised, strict=True)], f32,
                                device),
            repetition=to_device([q.repetition_penalty if on else 1.0 for q, on in zip(p, penalised, strict=True)], f32,
                                 device),
        )

    def sample(self, seqs: list[SeqStep], logits: torch.Tensor,
               argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SampleResult:
        """logits: [len(seqs), V], row i for seqs[i]. A sequence whose inputs or row fail is left out."""
        out = SampleResult()
        rows: list[SamplingRow] = []
        keep: list[int] = []
        states: list[tuple[torch.Generator, torch.Tensor]] = []  # seeded streams, to redo a failed batch
        for i, s in enumerate(seqs):
            try:
                r = self.row(s, logits.device)
                if r.generator is not None:
                    states.append((r.generator, r.generator.get_state()))
            except Exception as exc:
                out.errors[s.request_id] = describe(exc)
                continue
            rows.append(r)
            keep.append(i)
        if not rows:
            return out
        if len(keep) < len(seqs):
            logits = logits[keep]
        try:
            if all(r.params.greedy and r.params.logprobs is None and not r.bias and r.bitmask is None
                   and r.penalty is None for r in rows):
                # What `sample` would do with these rows' tensors, without building them.
                ids, lps = greedy(logits, argmax), None
            else:
                ids, lps = sample(logits, self.tensors(rows, logits.device), argmax)
            self._collect(out, rows, ids, lps)
        except Exception:
            # One row's parameters broke the batch: redo it row by row (from the same random state, so
            # seeded rows draw what they would have drawn) and fail only the rows that fail alone.
            for g, state in states:
                try:
                    g.set_state(state)
                except Exception:  # that row's own generator: it fails below, alone
                    pass
            for j, r in enumerate(rows):
                try:
                    ids, lps = sample(logits[j : j + 1], self.tensors([r], logits.device), argmax)
                    self._collect(out, [r], ids, lps)
                except Exception as exc:
                    out.errors[r.request_id] = describe(exc)
        return out

    @staticmethod
    def _collect(out: SampleResult, rows: list[SamplingRow], ids: list[int], lps: list[TokenLogprob] | None) -> None:
        for j, r in enumerate(rows):
            if ids[j] == NO_TOKEN:
                out.errors[r.request_id] = f"ValueError: {NO_TOKEN_LEFT}"
                continue
            out.sampled[r.request_id] = ids[j]
            if lps is not None and r.params.logprobs is not None:
                lp = lps[j]
                lp.top = lp.top[: r.params.logprobs]
                out.logprobs[r.request_id] = lp


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of the prompt tokens `targets` under rows of `logits` ([len(targets), V]), top-k each."""
    lps = logits.float().log_softmax(-1)
    return gather_logprobs(lps, to_device(targets, torch.long, logits.device), k)
