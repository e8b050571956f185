"""The model deployment: one engine per replica, driving its tensor-parallel actors.

Detokenization and stop strings run here, beside the engine, rather than in the tokenizer
deployment: a stop string then aborts the sequence in the same process, and each engine step costs
one streamed hop (a batch of text deltas for all of a request's choices) to the ingress.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace

from ray import serve

from rayllm.common.startup_phases import cold_start_record
from rayllm.loader.model_files import resolve_model_path
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerateRequest, GenerationDelta
from rayllm.protocol.structured import literal_choices
from rayllm.sample.guided import CompilerBusyError, GrammarCompiler
from rayllm.schema.config import EngineConfig
from rayllm.schema.outputs import RequestOutput, SequenceError, TokenLogprob
from rayllm.schema.sampling_params import GuidedSpec, SamplingParams
from rayllm.serve.deployment_options import warn_of_scaling
from rayllm.serve.detokenizer import IncrementalDetokenizer
from rayllm.serve.engine_errors import engine_failure, refusal, step_failure
from rayllm.serve.generation_modes import best_of, choose, scoring_fits
from rayllm.serve.lora.lora_registry import AdapterEntry, LoRARegistry
from rayllm.serve.metrics import forget_engine_stats, publish_engine_stats, stats_prefix
from rayllm.serve.serving_priority import ServingPriority
from rayllm.serve.tokenizer import TokenizerService
from rayllm.serve.tracing import TracingConfig, configure
from rayllm.serve.tracing_spans import ModelTrace, model_trace

log = logging.getLogger("ray.serve")

# The compiled-grammar cache holds this much (a compile's time bound: ServerConfig.grammar_compile_timeout_s).
GRAMMAR_CACHE_BYTES = 256 << 20
# vLLM's floor for reported logprobs: tokens a grammar or allowed_token_ids masks out are -inf, which JSON cannot carry.
MIN_LOGPROB = -9999.0


def replica_id() -> str | None:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica
        return None


def stats_key() -> str | None:
    """Where this replica writes its engine gauges for the ingress's /metrics (rayllm.serve.metrics)."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # outside a Serve replica
        return None
    return stats_prefix(ctx.app_name, ctx.deployment) + str(ctx.replica_id.unique_id)


def tag_replica(batch: list) -> None:
    """Debug: the first delta of a request carries the serving replica's id (the ingress returns it as
    the `x-replica-id` response header), so tests can see where Serve routed a request."""
    rid = replica_id()
    if rid is not None and batch and isinstance(batch[0], GenerationDelta):
        batch[0].replica_id = rid


def _token_logprobs(tok: TokenizerService, lps: list[TokenLogprob], as_ids: bool = False) -> list[dict]:
    ids = [lp.token_id for lp in lps] + [t for lp in lps for t, _ in lp.top]
    if as_ids:  # vLLM's return_tokens_as_token_ids: unambiguous names, their bytes those of the name
        strings = {t: f"token_id:{t}" for t in ids}
        raw = {t: list(name.encode()) for t, name in strings.items()}
    else:
        strings = dict(zip(ids, tok.token_strings(ids), strict=True))
        raw = dict(zip(ids, tok.token_bytes(ids), strict=True))
    return [{"token": strings[lp.token_id], "logprob": max(lp.logprob, MIN_LOGPROB), "bytes": raw[lp.token_id],
             "top_logprobs": [{"token": strings[t], "logprob": max(v, MIN_LOGPROB), "bytes": raw[t]}
                              for t, v in lp.top]}
            for lp in lps]


class LLMServer:
    def __init__(self, engine_config: EngineConfig, model_path: str, stream_interval_s: float = 0.0,
                 engine_process: bool = False, priority: ServingPriority | None = None,
                 tracing: TracingConfig | None = None, grammar_compile_timeout_s: float = 10.0):
        from rayllm.engine.client.engine_client import make_engine_client

        t0, started_at = time.perf_counter(), time.time()
        configure(tracing, "llm")  # spans of the requests that arrive with a traceparent
        self.stream_interval_s = stream_interval_s
        local_path = resolve_model_path(model_path)  # a remote spec: fetched to this node's cache here
        fetch_s = time.perf_counter() - t0
        self.tokenizer: TokenizerService

        tokenizer_s = 0.0

        def load_tokenizer() -> list[int]:  # with an engine process: while the child loads the model
            nonlocal tokenizer_s
            t = time.perf_counter()
            self.tokenizer = TokenizerService(local_path)
            tokenizer_s = time.perf_counter() - t
            return list(self.tokenizer.eos_token_ids)

        self.engine = make_engine_client(engine_config, load_tokenizer, own_process=engine_process)
        if self.engine.in_child_process:  # after its start: the engine child keeps normal priority
            (priority or ServingPriority()).step_back()
        self.config = engine_config
        warn_of_scaling(engine_config.scheduler.max_num_seqs)  # a Serve config's `deployments` section, as merged
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._compile_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-compile")
        # stop_regex searches run here, off the event loop (RE2 releases the GIL) and out of the default
        # pool that health checks use; each is bounded by the detokenizer's window.
        self._regex_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="stop-regex")
        self.loras = self._start_loras(engine_config)
        self._stats_key = stats_key()
        publish_engine_stats(self, engine_config.model.served_model_name, self._stats_key)  # running, waiting, KV
        self.startup = cold_start_record(engine_config.model.served_model_name, self.engine.startup_phases,
                                         fetch_s, time.perf_counter() - t0, tokenizer_s, started_at)
        log.info("cold start %s", json.dumps(self.startup))

    def _compile(self, spec: GuidedSpec):
        with self._grammars_lock:  # concurrent first compiles must not start two compiler children
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.transformers_tokenizer(), self.engine.vocab_size,
                                                 self.tokenizer.eos_token_ids, cache_bytes=GRAMMAR_CACHE_BYTES,
                                                 timeout_s=self.grammar_compile_timeout_s)
        return self._grammars.compile(spec)

    async def compile_grammar(self, spec: GuidedSpec):
        """Compile in a child process (cached), waited on from a pool of its own: a new schema never
        stalls the engine or other streams, and a slow one never holds the threads check_health uses."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compile_pool, self._compile, spec)
        except ValueError as exc:
            raise APIError(400, f"invalid {spec.param}: {exc}", param=spec.param, code="invalid_grammar") from None
        except CompilerBusyError as exc:
            raise APIError(503, str(exc), type="server_error", code="grammar_compiler_busy") from None

    def model_info(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "capacity_tokens": self.engine.capacity_tokens,
                "hidden_size": self.engine.arch.hidden_size}

    def cold_start(self) -> dict:
        """This replica's start-up by phase (the `cold start` log line; benchmarks/cold_start.py)."""
        return self.startup

    def stats(self) -> dict:
        grammars = self._grammars.num_compiled if self._grammars is not None else 0
        return vars(self.engine.stats()) | {"grammars_compiled": grammars}

    async def engine_stats(self) -> dict:
        """stats() off the replica's event loop (an engine process answers between two steps): for a watcher
        that polls a loaded replica (benchmarks/engine_stats_watch.py) without holding its streams back."""
        return await asyncio.to_thread(self.stats)

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising marks the replica unhealthy and replaces it."""
        await asyncio.to_thread(self.engine.check_health)

    async def _choice(self, req: GenerateRequest, index: int, prompt: list[int], out: asyncio.Queue,
                      grammar=None, lora_id: int = 0, trace: ModelTrace | None = None) -> None:
        """Run one choice to its end, pushing GenerationDelta objects into the shared queue."""
        params = req.params
        choice = index % req.n
        if params.seed is not None and choice:
            params = replace(params, seed=params.seed + choice)  # n seeded choices must differ
        stop = req.stop
        detok = IncrementalDetokenizer(
            self.tokenizer.tokenizer,
            prompt,
            stop=stop.stop,
            stop_regex=stop.stop_regex,
            include_stop_str_in_output=stop.include_stop_str_in_output,
            skip_special_tokens=stop.skip_special_tokens,
            spaces_between_special_tokens=stop.spaces_between_special_tokens,
            min_tokens=params.min_tokens,
        )
        completion_tokens, matched = 0, None
        first = True
        rid = f"{req.trace_id}:{req.request_id}-{index}" if req.trace_id else f"{req.request_id}-{index}"
        # Traced: the engine phases come with its last output, also the abort's after a stop string (read then).
        on_end = trace.choice(index, lambda: (completion_tokens, matched)) if trace is not None else None
        try:
            async with aclosing(self.engine.generate(rid, prompt, params, lora_id, grammar, on_end)) as outputs:
                async for o in outputs:
                    completion_tokens += len(o.new_token_ids)
                    text, matched = "", None
                    if o.new_token_ids and stop.stop_regex:
                        text, matched = await asyncio.get_running_loop().run_in_executor(
                            self._regex_pool, detok.add, o.new_token_ids)
                    elif o.new_token_ids:
                        text, matched = detok.add(o.new_token_ids)
                    finish, matched_stop = o.finish_reason, None
                    if matched is not None:
                        finish, matched_stop = "stop", matched
                    elif o.finished:
                        text += detok.flush()
                        if o.finish_reason == "stop" and o.stop_token_id is not None:
                            matched_stop = o.stop_token_id
                    delta = GenerationDelta(
                        index=index,
                        text=text,
                        token_ids=o.new_token_ids,
                        logprobs=_token_logprobs(self.tokenizer, o.logprobs, stop.tokens_as_ids) if o.logprobs else None,
                        finish_reason=finish if (o.finished or matched is not None) else None,
                        matched_stop=matched_stop,
                        prompt_tokens=o.num_prompt_tokens,
                        cached_tokens=o.num_cached_tokens,
                        completion_tokens=completion_tokens,
                        hidden_states=o.hidden_states,
                    )
                    if first:
                        first = False
                        if req.echo_texts is not None:
                            delta.prompt_text = req.echo_texts[index // req.n]
                        if o.prompt_logprobs is not None:
                            delta.prompt_logprobs = self._prompt_logprobs(o, prompt[0], stop.tokens_as_ids)
                    out.put_nowait(delta)
                    if matched is not None:  # leaving aborts it now (aclosing), not when the generator is
                        break  # collected: an adapter's slot may be reused once this task has ended
        except asyncio.CancelledError:  # client gone: leaving the generator aborted it in the engine
            log.info("aborted %s", rid)  # rid starts with the HTTP request's X-Request-Id
            raise
        except SequenceError as exc:  # this sequence's own fault inside a step; the others went on
            out.put_nowait(step_failure(exc))
        except ValueError as exc:  # the engine refused the request (length, capacity, constraint size)
            out.put_nowait(refusal(exc, req.guided.param if req.guided is not None else None))
        except Exception as exc:
            out.put_nowait(engine_failure(exc))

    def _prompt_logprobs(self, o: RequestOutput, first_token: int, as_ids: bool = False) -> list[dict | None]:
        """The first prompt token has no logprob: it is reported with its text and a null value."""
        assert o.prompt_logprobs is not None
        rest = [lp for lp in o.prompt_logprobs if lp is not None]
        (head,) = _token_logprobs(self.tokenizer, [TokenLogprob(first_token, 0.0)], as_ids)
        return [head | {"logprob": None}] + _token_logprobs(self.tokenizer, rest, as_ids)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[list[GenerationDelta]]:
        """Yields batches of deltas (whatever all choices produced since the last yield)."""
        with model_trace(req, self.config.model.served_model_name) as trace:  # None unless it is traced
            async with aclosing(self._generate(req, trace)) as batches:  # closed (aborted) with this one
                async for batch in batches:
                    if trace is not None:
                        trace.observe(batch)
                    yield batch

    async def _generate(self, req: GenerateRequest, trace: ModelTrace | None) -> AsyncIterator[list[GenerationDelta]]:
        if req.best_of is not None and req.best_of > req.n:
            yield await best_of(self, req)
            return
        choices = literal_choices(req.guided)
        if choices is not None and scoring_fits(req, choices):
            yield await choose(self, req, choices)
            return
        grammar = await self.compile_grammar(req.guided) if req.guided is not None else None
        queue: asyncio.Queue = asyncio.Queue()
        adapter = await self._acquire_lora(req, queue)
        lora_id = adapter.lora_id if adapter is not None else 0
        total = len(req.prompts) * req.n
        tasks = [
            asyncio.create_task(self._choice(req, i, req.prompts[i // req.n], queue, grammar, lora_id, trace))
            for i in range(total)
        ]
        finished = 0
        loop = asyncio.get_running_loop()
        last_yield: float | None = None
        try:
            while finished < total:
                batch = [await queue.get()]
                if last_yield is not None and self.stream_interval_s > 0:
                    # Coalesce tokens into fewer, larger stream messages: each hop costs CPU on every
                    # process it crosses. The first delta (time to first token) is never delayed.
                    delay = last_yield + self.stream_interval_s - loop.time()
                    if delay > 0 and not any(d.finish_reason for d in batch if isinstance(d, GenerationDelta)):
                        await asyncio.sleep(delay)
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                finished += sum(1 for d in batch if d.finish_reason is not None)
                if last_yield is None:
                    tag_replica(batch)
                last_yield = loop.time()
                yield batch
        finally:
            for t in tasks:  # client gone or error: cancel every choice, which aborts it in the engine
                t.cancel()
            if adapter is not None:  # the adapter's slot may be freed once every choice's abort is submitted
                done = asyncio.gather(*tasks, return_exceptions=True)
                done.add_done_callback(lambda _: self.loras.release(adapter, queue))  # type: ignore[union-attr]

    async def embed(self, request_id: str, prompts: list[list[int]], cache_salt: str | None = None,
                    tenant: str | None = None) -> list[list[float]]:
        """One /v1/embeddings request: every input as a pooling sequence in the engine, batched with the
        rest of its work (and counted in its tenant's running share); unit-length vectors in input order."""
        params = SamplingParams(embed=True, cache_salt=cache_salt, tenant=tenant)

        async def one(i: int, prompt: list[int]) -> list[float]:
            async for o in self.engine.generate(f"{request_id}-{i}", prompt, params):
                if o.embedding is not None:
                    return o.embedding
            raise APIError(500, "The engine finished an embedding without a vector.", type="server_error")

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except SequenceError as exc:
            raise step_failure(exc) from exc
        except ValueError as exc:  # the engine refused an input (length, capacity)
            raise APIError(400, str(exc), param="input") from exc  # an embedding's one field
        except APIError:
            raise
        except Exception as exc:
            raise engine_failure(exc) from exc
        finally:
            for t in tasks:  # an input failed or the client left: abort the others in the engine
                t.cancel()

    # ---- LoRA adapters ----------------------------------------------------------------------------

    def _start_loras(self, config: EngineConfig) -> LoRARegistry | None:
        if not config.lora.enabled:
            return None
        registry = LoRARegistry(config.lora, self.engine, on_evict=self._forget_multiplexed)
        for name, path in config.lora.adapters:  # cluster.yaml's adapters: loaded (and checked) at start
            registry.load_now(name, path)
        return registry

    def _registry(self) -> LoRARegistry:
        if self.loras is None:
            raise APIError(400, "LoRA adapters are disabled on this server (set engine.lora.max_loras)",
                           param="model", code="lora_disabled")
        return self.loras

    @serve.multiplexed(max_num_models_per_replica=-1)
    async def _multiplexed_adapter(self, model_id: str) -> str:
        """Serve's multiplexing cache: it reports which adapters this replica holds, so the router
        sends requests for an adapter here. Capacity and LRU eviction are the registry's (its size
        comes from the config, which a class-level decorator cannot read); evictions are mirrored
        back with _forget_multiplexed."""
        return model_id

    def _forget_multiplexed(self, name: str) -> None:
        # Best effort through Serve's private cache object; if its layout changes, routing hints for
        # an evicted adapter merely go stale (the replica then loads it again on request).
        wrapper = getattr(self, "__serve_multiplex_wrapper", None)
        models = getattr(wrapper, "models", None)
        if isinstance(models, dict) and models.pop(name, None) is not None:
            wrapper._push_multiplexed_replica_info = True  # type: ignore[union-attr]

    async def _acquire_lora(self, req: GenerateRequest, queue: asyncio.Queue) -> AdapterEntry | None:
        if req.lora is None:
            return None
        assert req.lora_path is not None  # waiting for a slot: in the engine's order (fcfs ignores priority)
        priority = req.params.priority if self.config.scheduler.policy == "priority" else 0
        entry = await self._registry().acquire(req.lora, req.lora_path, queue, priority)
        if serve.get_multiplexed_model_id() == req.lora:  # only once it loaded: Serve's table never forgets
            await self._multiplexed_adapter(req.lora)
        return entry

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """Load on this replica (the ingress routes the call with multiplexed_model_id=name)."""
        entry = await self._registry().load(name, path)
        if serve.get_multiplexed_model_id() == name:
            await self._multiplexed_adapter(name)
        return entry.card() | {"replica_id": replica_id()}

    async def unload_lora_adapter(self, name: str) -> bool:
        """Aborts the requests using it; returns once the engine has dropped them and the slot is free."""
        self._forget_multiplexed(name)
        return await self._registry().unload(name)

    def lora_adapters(self) -> dict:
        """This replica's resident adapters (debugging, tests)."""
        entries = list(self.loras.entries.values()) if self.loras is not None else []
        return {"replica_id": replica_id(), "adapters": [e.card() for e in entries]}

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            pass
        if getattr(self, "_stats_key", None):
            forget_engine_stats(self._stats_key)


# Defaults as in cluster.yaml: a bounded caller-side queue (503 beyond it), and a drain period for open streams.
LLMDeployment = serve.deployment(name="llm", max_ongoing_requests=256, max_queued_requests=512,
                                 health_check_period_s=10, graceful_shutdown_timeout_s=60)(LLMServer)
