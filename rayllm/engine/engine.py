"""The engine: add_request / abort, and step() = schedule -> execute -> postprocess.

`LLMEngine` is synchronous and single-threaded; an engine client (engine_client.py) drives it from a
thread or a child process. A fault that belongs to one sequence (its sampling inputs, grammar matcher, adapter) aborts
that sequence with an error for its request (`RequestOutput.error`); the step goes on for the others.
The device running out of memory in a step (`StepOutOfMemory`) fails that step's requests alone. Any other
fault nobody owns (the model forward, a collective) escapes `step()` and ends the engine.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from rayllm.common import startup_phases
from rayllm.common.errors import describe, first_line
from rayllm.engine.block_manager import BlockManager
from rayllm.engine.scheduler import ScheduledSeq, Scheduler
from rayllm.engine.sequence import Sequence
from rayllm.executor.executor import make_executor, resolve_local_device
from rayllm.loader.loader import read_arch
from rayllm.loader.model_files import resolve_model_path
from rayllm.models.registry import kv_window
from rayllm.sample.guided import new_matcher, next_token_bitmask
from rayllm.schema.config import EngineConfig
from rayllm.schema.outputs import (
    EngineDeadError,
    EngineStats,
    EngineTimings,
    RequestOutput,
    RequestRefused,
    SequenceError,
    StepOutOfMemory,
    TokenLogprob,
)
from rayllm.schema.sampling_params import SamplingParams
from rayllm.schema.step import SeqStep, StepInput

log = logging.getLogger(__name__)

__all__ = ["EngineDeadError", "EngineStats", "GrammarViolation", "LLMEngine", "SequenceError"]


class GrammarViolation(RuntimeError):
    """A sampled token the sequence's grammar rejects (its allowed-token mask was not honoured)."""


def banned_next(words: tuple[tuple[int, ...], ...], token_ids: list[int], num_output: int) -> tuple[int, ...]:
    """vLLM's bad_words: the tokens that would complete a bad word now, given the output so far (the prompt
    does not count: a word may start only in the output)."""
    out = []
    last = token_ids[-1] if num_output else None
    for w in words:
        k = len(w) - 1
        # The last token first: a step pays one comparison per word unless the word is under way.
        if k == 0 or (k <= num_output and w[-2] == last and tuple(token_ids[len(token_ids) - k :]) == w[:-1]):
            out.append(w[-1])
    return tuple(out)


class LLMEngine:
    def __init__(self, config: EngineConfig, eos_token_ids: list[int] | None = None):
        config = resolve_local_device(config)  # `auto` device and block size, as the executor sees them
        self.config = config
        t0 = time.perf_counter()
        with startup_phases.phase("download"):  # a remote source's fetch; a local path: a stat
            self.model_path = resolve_model_path(config.model.model, config.model.revision)
        with startup_phases.phase("arch"):  # the checkpoint's header: config.json or the GGUF's metadata
            self.arch = read_arch(self.model_path)
        self.max_model_len = min(config.model.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.executor = make_executor(config, self.model_path, self.arch)
        self.block_manager = BlockManager(
            self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, kv_window(self.arch)
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        eos = set(eos_token_ids or [])
        if self.arch.eos_token_id is not None:
            eos.add(int(self.arch.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.seqs: dict[str, Sequence] = {}
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []  # penalty state the driver is to drop (SamplingInputs.preempted)
        self.num_steps = 0
        self.step_seconds = 0.0
        self.execute_seconds = 0.0
        self.startup_phases = startup_phases.recorded() | {"engine": round(time.perf_counter() - t0, 3)}
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d",
                 self.executor.num_blocks, config.cache.block_size, self.max_model_len)

    @property
    def capacity_tokens(self) -> int:
        return self.executor.num_blocks * self.config.cache.block_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora_slot: int = 0,
                    grammar: Any = None):
        """grammar: an xgrammar CompiledGrammar (guided.GrammarCompiler) constraining the output, or None."""
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_token_ids:
            raise RequestRefused("empty prompt", param="prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.arch.vocab_size:
            raise RequestRefused(f"prompt token ids must be in [0, {self.arch.vocab_size})", param="prompt")
        total = len(prompt_token_ids) + (0 if params.embed else params.max_tokens)  # pooling: prefill only
        if total > self.max_model_len:
            raise RequestRefused(f"prompt ({len(prompt_token_ids)}) + max_tokens ({0 if params.embed else params.max_tokens}) "
                                 f"exceeds max_model_len {self.max_model_len}", param="max_tokens")
        if self.block_manager.max_blocks_held(total, self.config.scheduler.max_num_batched_tokens) > self.executor.num_blocks:
            raise RequestRefused(f"request needs {total} tokens of KV cache; the cache holds {self.capacity_tokens}",
                                 param="max_tokens")
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params, lora_slot,
                       arrival_ns=time.time_ns())
        if params.embed:
            seq.pooling = self.config.model.pooling
        elif grammar is not None:
            seq.matcher = new_matcher(grammar)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        self._finished_ids.append(request_id)
        return self._output(seq, [], None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's content (blocks in use keep theirs); returns the blocks forgotten."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), self.scheduler.num_waiting, bm.usage,
                           bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0,
                           self.scheduler.num_preemptions, self.num_steps, self.step_seconds,
                           self.execute_seconds, *self.executor.device_memory())

    def _seq_step(self, sc: ScheduledSeq) -> SeqStep:
        seq, n = sc.seq, sc.num_tokens
        start = seq.num_computed_tokens
        p = seq.params
        samples = sc.samples
        step = SeqStep(seq.request_id, seq.token_ids[start : start + n], start, seq.block_table, samples,
                       num_prompt_tokens=seq.num_prompt_tokens, lora_slot=seq.lora_slot)
        if samples or p.prompt_logprobs is not None:
            step.params = p
        if seq.pooling == "mean" or (seq.pooling == "last" and start + n == seq.num_tokens):
            step.pool = seq.pooling
        if samples:
            if p.needs_penalties and (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1):
                # Only what the driver's penalty state lacks: one token per decode step.
                step.history_start = seq.penalty_synced
                step.history = seq.token_ids[seq.penalty_synced :]
                seq.penalty_synced = seq.num_tokens
            if seq.num_output_tokens < p.min_tokens:
                step.mask_token_ids = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids))
            if p.bad_words_token_ids:
                step.mask_token_ids += banned_next(p.bad_words_token_ids, seq.token_ids, seq.num_output_tokens)
            if seq.matcher is not None:
                step.allowed_bitmask = next_token_bitmask(seq.matcher, self.arch.vocab_size)
        if p.prompt_logprobs is not None and not seq.prompt_logprobs_sent and start < seq.num_prompt_tokens:
            if start == 0:
                seq.prompt_logprobs = [None]  # the first prompt token has no logprob
            # Row i of the chunk predicts token start+i+1, as long as that is still a prompt token.
            step.prompt_logprob_targets = seq.token_ids[start + 1 : min(start + n + 1, seq.num_prompt_tokens)]
        return step

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        for seq in self.scheduler.preempted:
            if seq.penalty_synced:
                seq.penalty_synced = 0
                self._preempted_ids.append(seq.request_id)
        self.scheduler.preempted.clear()
        outputs: list[RequestOutput] = []
        runnable = []
        for sc in scheduled:
            if sc.seq.is_finished:  # could never fit the KV cache
                self.seqs.pop(sc.seq.request_id, None)
                self._finished_ids.append(sc.seq.request_id)
                outputs.append(self._output(sc.seq, [], None))
            else:
                runnable.append(sc)
        if not runnable:
            return outputs
        now = time.time_ns()
        for sc in runnable:
            if not sc.seq.scheduled_ns:
                sc.seq.scheduled_ns = now
        # Decode sequences first: the attention backends batch them together.
        runnable.sort(key=lambda sc: sc.num_tokens != 1)
        samples = [sc.samples for sc in runnable]
        errors: dict[str, str] = {}
        step_input = StepInput([self._safe_seq_step(sc, errors) for sc in runnable], self._finished_ids,
                               self._preempted_ids)
        self._finished_ids, self._preempted_ids = [], []
        t_exec = time.perf_counter()
        try:
            result = self.executor.execute(step_input)
        except StepOutOfMemory as exc:
            return outputs + self._fail_step(runnable, step_input, first_line(exc))
        self.execute_seconds += time.perf_counter() - t_exec
        errors.update(result.errors)
        for sc, sampled in zip(runnable, samples, strict=True):
            seq = sc.seq
            error = errors.get(seq.request_id)
            if error is None:
                try:
                    out = self._advance(sc, sampled, result)
                except Exception as exc:  # its grammar matcher, its stop check: this sequence alone
                    log.exception("request %s failed after its step", seq.request_id)
                    error = describe(exc)
                else:
                    if out is not None:
                        outputs.append(out)
                    continue
            outputs.append(self._fail(seq, error))
        return outputs

    def _safe_seq_step(self, sc: ScheduledSeq, errors: dict[str, str]) -> SeqStep:
        """The sequence's step; if building it fails, the sequence still computes its tokens (a request
        admitted beside it may share those blocks) but samples nothing, and fails after the step."""
        try:
            return self._seq_step(sc)
        except Exception as exc:
            log.exception("request %s: preparing its step failed", sc.seq.request_id)
            errors[sc.seq.request_id] = describe(exc)
            seq, start = sc.seq, sc.seq.num_computed_tokens
            return SeqStep(seq.request_id, seq.token_ids[start : start + sc.num_tokens], start, seq.block_table,
                           False, lora_slot=seq.lora_slot)

    def _fail_step(self, runnable: list[ScheduledSeq], step: StepInput, detail: str) -> list[RequestOutput]:
        """The device ran out of memory in this step: its requests fail, the engine serves on. The blocks the
        step fills were hashed when scheduled but may hold no KV now, so the prefix cache forgets them (and
        only them: earlier steps' blocks hold their KV); the requests that finished (or were preempted) before
        the step are still to be forgotten by the workers."""
        self._finished_ids = step.finished_request_ids + self._finished_ids
        self._preempted_ids = step.preempted_request_ids + self._preempted_ids
        bm, bs = self.block_manager, self.block_manager.block_size
        for sc in runnable:
            seq = sc.seq
            for i in range(seq.num_computed_tokens // bs,
                           min((seq.num_computed_tokens + sc.num_tokens) // bs, len(seq.block_hashes))):
                block = bm.blocks[seq.block_table[i]]
                if block.hash == seq.block_hashes[i] and bm.hash_to_block.get(block.hash) == block.block_id:
                    del bm.hash_to_block[block.hash]  # as an evicted block: unreachable, then reused
                    block.hash, block.token_ids = None, ()
        error = f"OutOfMemoryError: the model step ran out of device memory ({detail}); retry the request"
        return [self._fail(sc.seq, error) for sc in runnable]

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Abort one sequence with `error` for its request; the step goes on for the others."""
        log.warning("request %s failed: %s", seq.request_id, error)
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        if self.seqs.pop(seq.request_id, None) is not None:
            self._finished_ids.append(seq.request_id)
        out = self._output(seq, [], None)
        out.error = error
        return out

    def _advance(self, sc: ScheduledSeq, sampled: bool, result) -> RequestOutput | None:
        """Record a sequence's step: computed tokens, prompt logprobs, its sampled token and stop check."""
        seq = sc.seq
        seq.num_computed_tokens += sc.num_tokens
        prompt_lps = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            # A chunk holding only the last prompt token (a 1-token prompt too) has no targets and no entry
            # in the result, yet it completes the prompt: the logprobs go out all the same.
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(seq.request_id, ()))
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                prompt_lps = seq.prompt_logprobs
                seq.prompt_logprobs_sent = True
        if seq.pooling is not None:
            return self._pooled(sc, result.pooled[seq.request_id]) if seq.request_id in result.pooled else None
        if not sampled:
            return self._output(seq, [], None, prompt_lps) if prompt_lps is not None else None
        token = result.sampled[seq.request_id]
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            # The matcher did not advance: whatever followed would no longer obey the grammar. The caller fails
            # this sequence alone.
            raise GrammarViolation(f"the sampled token {token} is not allowed by the request's grammar")
        seq.token_ids.append(token)
        if not seq.first_token_ns:
            seq.first_token_ns = time.time_ns()
        self._check_stop(seq, token)
        out = self._output(seq, [token], result.logprobs.get(seq.request_id), prompt_lps)
        if seq.request_id in result.hidden_states:
            out.hidden_states = [result.hidden_states[seq.request_id]]
        if seq.is_finished:
            self.seqs.pop(seq.request_id, None)
            self._finished_ids.append(seq.request_id)
        return out

    def _pooled(self, sc: ScheduledSeq, rows: list[float]) -> RequestOutput | None:
        """Accumulate a pooling sequence's chunk; once its prompt is computed, finish it (its blocks are
        freed at once) with the unit-length embedding."""
        seq = sc.seq
        if seq.pooling == "mean":
            first = seq.num_computed_tokens == sc.num_tokens  # from position 0 (again, after a preemption)
            seq.pool_sum = rows if first or seq.pool_sum is None else [a + b for a, b in zip(seq.pool_sum, rows,
                                                                                             strict=True)]
            rows = seq.pool_sum
        if seq.num_computed_tokens < seq.num_tokens:
            return None
        norm = math.sqrt(sum(x * x for x in rows)) or 1.0  # the mean's 1/n cancels in the normalisation
        self.scheduler.finish(seq, "stop")
        self.seqs.pop(seq.request_id, None)
        self._finished_ids.append(seq.request_id)
        out = self._output(seq, [], None)
        out.embedding = [x / norm for x in rows]
        return out

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        reason = None
        if seq.matcher is not None and seq.matcher.is_terminated():
            reason = "stop"  # the grammar is complete: it accepted a stop token
            seq.stop_token_id = token
        elif seq.num_output_tokens >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            reason = "stop"
            seq.stop_token_id = token
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)

    def _output(self, seq: Sequence, new: list[int], lp: TokenLogprob | None,
                prompt_lps: list[TokenLogprob | None] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_token_id=seq.stop_token_id,
            logprobs=[lp] if lp is not None else None,
            prompt_logprobs=prompt_lps,
            timings=EngineTimings(seq.arrival_ns, seq.scheduled_ns, seq.first_token_ns, time.time_ns())
            if seq.is_finished else None,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline helper: run prompts to completion together; returns each one's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]

    def shutdown(self) -> None:
        self.executor.shutdown()
