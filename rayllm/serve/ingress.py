"""HTTP ingress: OpenAI routes on FastAPI through serve.ingress. Thin: validate -> tokenize -> generate -> stream."""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle

from rayllm.protocol import conversations as C
from rayllm.protocol import protocol as P
from rayllm.protocol.chat_output import output_parser_factory
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerateRequest
from rayllm.protocol.sse import ChatFormat, CompletionFormat, OpenAIFormat, WireFormat
from rayllm.protocol.structured import guided_spec
from rayllm.protocol.tools import ToolPlan, plan_tools
from rayllm.serve.auth import Access, cache_salt
from rayllm.serve.config import ServerConfig
from rayllm.serve.drain import STATE as DRAIN
from rayllm.serve.drain import watch as watch_drain
from rayllm.serve.generation_stream import Generation, OnComplete
from rayllm.serve.lora.shared_adapters import SharedAdapters
from rayllm.serve.metrics import server_metrics
from rayllm.serve.model_status import ServeModelStatus, wake
from rayllm.serve.owner_limits import OwnerLimits, released
from rayllm.serve.request_guards import (
    call_model,
    check_chat_template,
    check_request,
    check_sampling,
    check_token_list,
    check_tokens,
)
from rayllm.serve.routes import ops_routes as ops
from rayllm.serve.routes.conversation_routes import ConversationRoutes, chat_turn_room
from rayllm.serve.routes.embeddings_routes import EmbeddingsRoutes
from rayllm.serve.routes.http_app import app, parse, request_id_of
from rayllm.serve.routes.model_routes import ModelRoutes
from rayllm.serve.routes.playground import PlaygroundRoutes
from rayllm.serve.routes.responses_routes import ResponsesRoutes
from rayllm.serve.serving_priority import ServingPriority
from rayllm.serve.stores.adapter_store import AdapterStore
from rayllm.serve.stores.completion_store import completion_store
from rayllm.serve.stores.conversation_store import ConversationStore
from rayllm.serve.tracing import client_span, configure
from rayllm.serve.tracing_spans import dispatch, traced_storage

log = logging.getLogger("ray.serve")

# graceful_shutdown_timeout_s: on redeploy or scale-down, open streams get this long to finish (as cluster.yaml).
@serve.deployment(name="ingress", max_ongoing_requests=1000, graceful_shutdown_timeout_s=60)
@serve.ingress(app)
class Ingress(ResponsesRoutes, ConversationRoutes, PlaygroundRoutes, EmbeddingsRoutes):
    def __init__(self, config: ServerConfig, tokenizer: DeploymentHandle, llms: dict[str, DeploymentHandle]):
        ServingPriority.of(config).step_back()
        self.config = config
        self.created = int(time.time())
        self.routes = ModelRoutes(config.models, llms, tokenizer, self.created)
        self.keys = Access.from_entries(config.api_keys, config.admin_api_keys, config.metrics_require_key,
                                       config.allow_runtime_lora_updating)
        self.store = ConversationStore(config.storage_url, config.storage_timeout_s, config.storage_pool_size)
        context = serve.get_replica_context()
        app_name = context.app_name
        # make serve's graceful stop: 503 to new requests while those in flight finish (rayllm/serve/drain.py)
        DRAIN.retry_after_s = config.retry_after_s
        # The bound the launcher waits for this replica's open requests: its own drain time (cluster.yaml's
        # value where it overrides the code's; the replica context is where Serve keeps the merged config).
        watch_drain(app_name, context.replica_tag, context._deployment_config.graceful_shutdown_timeout_s)
        # Adapters loaded at runtime: in the store, for every ingress replica (rayllm/serve/lora/shared_adapters.py)
        self.shared_adapters = SharedAdapters(AdapterStore(self.store, app_name), self.routes)
        self.metrics = server_metrics()
        # Serve's controller, not the replicas, answers "is the model up" (scale to zero: nothing wakes it)
        self.model_status = ServeModelStatus(app_name)
        self.health_log = ops.HealthLog()
        self.owner_limits = OwnerLimits.of(config)  # per key, beside the engine's max_running_share
        app.state.max_request_bytes = config.max_request_bytes  # read by parse() (module level)
        configure(config.tracing, "ingress")  # OpenTelemetry spans, when cluster.yaml's tracing.enabled

    # The model this request selected (check_model; rayllm.serve.routes.model_routes): its deployment, tokenizer...
    llm = property(lambda self: self.routes.current.llm)
    tokenizer = property(lambda self: self.routes.current.tokenizer)
    model_name = property(lambda self: self.routes.current.name)
    adapters = property(lambda self: self.routes.current.adapters)

    async def info(self) -> dict:
        route = self.routes.current
        state = await self.model_status.for_request(route.llm.deployment_name)
        await wake(route.name, state, lambda: call_model(route.llm.model_info.remote(), self.config.retry_after_s),
                   self.config.wake_timeout_s, self.config.retry_after_s)
        return await call_model(route.info(), self.config.retry_after_s)

    async def idle(self) -> frozenset[str]:
        """The models with no running replica now (Serve's status): scaled to zero, starting or failed."""
        states = await self.model_status.states()
        return frozenset(r.name for r in self.routes
                         if r.llm.deployment_name in states and states[r.llm.deployment_name].running == 0)

    def check_auth(self, request: Request) -> str:
        """The caller's owner id (a digest of its key; "" with auth off), or a 401."""
        return self.keys.owner(request.headers.get("authorization"))

    def check_model(self, model: str | None) -> None:
        """Selects the model `model` names for the rest of this request (404 for an unknown one)."""
        self.routes.select(model)

    async def select_model(self, model: str | None, lora_path: str | list[str | None] | None = None) -> None:
        """check_model, once the adapters loaded at runtime that `model` or `lora_path` may name are known."""
        await self.shared_adapters.lookup(model, lora_path)
        self.routes.select(model)

    async def render(self, messages: list[dict], chat_template: str | None = None, **kw) -> tuple[str, list[int]]:
        try:
            with client_span("render") as traceparent:  # None unless this request is traced
                if traceparent is not None:
                    kw["traceparent"] = traceparent
                if chat_template is None:  # the model's own template: coalesced with other requests' renders
                    return await self.routes.current.renderer.render(messages, **kw)
                return await self.tokenizer.render_chat.remote(messages, chat_template=chat_template, **kw)
        except ValueError as exc:  # template or message-shape problems are the client's
            raise APIError(400, str(exc).splitlines()[-1] if str(exc) else "invalid messages",
                           param="messages") from None

    def openai_format(self, cls: type[OpenAIFormat], greq: GenerateRequest, req: P.SamplingFields,
                      state: GenerationState) -> OpenAIFormat:
        usage = bool(req.stream_options and req.stream_options.include_usage)  # only with stream (request_models)
        return cls(state, request_id=greq.request_id, model=req.model or self.model_name, created=int(time.time()),
                   include_usage=usage,  # vLLM: per-chunk usage only with the final usage chunk asked for too
                   continuous_usage_stats=usage and bool(req.stream_options.continuous_usage_stats),
                   trace_id=greq.trace_id or None,
                   prompt_token_ids=greq.prompts if req.return_token_ids else None)

    async def run(self, greq: GenerateRequest, fmt: WireFormat, req: P.SamplingFields,
                  on_complete: OnComplete | None = None):
        """One generation, streamed or whole (rayllm.serve.generation_stream); `on_complete` (storage) runs
        after the last delta, before the response ends."""
        t0 = time.monotonic()
        # The key's share of the model's queue (scheduler.max_running_share): a 429 past it; held until the end.
        release = self.owner_limits.enter(self.model_name, greq.params.tenant)
        try:
            greq.traceparent = dispatch(greq, self.model_name)  # None unless this request is traced
            call = self.routes.current.llm_for(greq.lora).options(stream=True).generate.remote(greq)
            gen = Generation(call, fmt, metrics=self.metrics, model=(greq.lora and getattr(req, "model", None)) or
                             self.model_name, t0=t0, timeout_s=self.config.request_timeout_s,
                             retry_after_s=self.config.retry_after_s, on_complete=traced_storage(on_complete))
            if not req.stream:
                body = await gen.body()
                release()
                return JSONResponse(body.model_dump() if isinstance(body, BaseModel) else body, headers=gen.headers)
            await gen.start()  # early refusals stay plain HTTP errors
        except BaseException:
            release()
            raise
        return StreamingResponse(released(gen.events(), release), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | gen.headers)

    @app.get("/health")
    async def health(self) -> Response:
        needed = {h.deployment_name: h for r in self.routes for h in (r.llm, r.tokenizer.handle)}
        return await ops.health(list(needed.values()), self.model_status, self.health_log)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        return ops.openapi(self.keys)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        return await ops.metrics(request, self.keys, {r.name: r.llm for r in self.routes}, self.metrics,
                                 self.model_status)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        await self.shared_adapters.read()
        return JSONResponse({"object": "list", "data": await self.routes.cards(await self.idle())})

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        self.check_auth(request)
        await self.shared_adapters.lookup(model_id)
        route = self.routes.find(model_id)
        name = route.adapters.name_of(model_id)
        if name is not None and name in route.adapters:
            return JSONResponse(route.adapters.card(name))
        if name is not None:
            raise self.routes.unknown(model_id)
        return JSONResponse(await route.card(model_id if model_id in route.aliases else None,
                                             idle=route.name in await self.idle()))

    # ---- LoRA adapters -----------------------------------------------------------------------------

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return await ops.load_adapter(request, self.keys, self.routes, self.shared_adapters)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return await ops.unload_adapter(request, self.keys, self.routes, self.shared_adapters)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, P.ChatCompletionRequest)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        last_input = messages[-1]  # what `store` keeps (before any history is merged in)
        cid = C.conversation_id(req.conversation)
        if cid is not None:
            history = await self.conversation_history(owner, cid, *chat_turn_room(req, last_input))
            messages = C.with_history(C.history_messages(history), messages)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        greq, parser_factory = await self.prepare_chat(request, owner, req, messages, rid)
        save = completion_store(self.store, self.model_name, owner, req, cid, rid, last_input) if req.store else None
        fmt = self.openai_format(ChatFormat, greq, req, GenerationState(greq.n, parser_factory))
        return await self.run(greq, fmt, req, on_complete=save)

    async def prepare_chat(self, request: Request, owner: str, req: P.ChatCompletionRequest, messages: list[dict],
                           rid: str, param: str = "messages") -> tuple[GenerateRequest, Any]:
        """What /v1/chat/completions and /v1/responses share: adapter, bounds, constraint, tools, template,
        sampling. Returns the engine request and the output parser factory (rayllm.protocol.chat_output)."""
        await self.select_model(req.model, req.lora_path)
        lora = self.adapters.resolve(req.model, req.lora_path)
        guided = guided_spec(req)
        seqs = check_request(self.config, req, 1, guided)
        P.check_supported(req)
        tool_format = self.config.tool_parser
        if tool_format == "auto":
            tool_format = (await self.tokenizer_info())["tool_format"]
        plan = plan_tools(req, other_constraint=guided is not None, tool_format=tool_format)
        if plan is not None and plan.guided is not None:
            guided = plan.guided
        text, ids = await self.render(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=P.template_kwargs(req),
            tools=plan.template_tools if plan is not None and plan.mode != "none" else None,
        )
        info = await self.info()
        ids = P.truncate_prompt(ids, req.truncate_prompt_tokens, info["max_model_len"])
        context = check_tokens(self.config, req, len(ids), param, info["max_model_len"])
        params = replace(P.to_sampling_params(req, prompt_len=len(ids), max_model_len=context),
                         cache_salt=cache_salt(owner, req.cache_salt), tenant=owner or None,
                         bad_words_token_ids=await self.bad_words(req))
        check_sampling(self.config, req, seqs, params.max_tokens, (await self.tokenizer_info())["vocab_size"])
        greq = GenerateRequest(rid, [ids], params, P.stop_options(req), n=req.n or 1, guided=guided,
                               lora=lora[0], lora_path=lora[1], trace_id=request_id_of(request))
        return greq, await self.output_parser(req, plan, text, guided is not None)

    async def bad_words(self, req: P.SamplingFields) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as the token sequences the engine bans (one round trip to the tokenizer)."""
        if not req.bad_words:
            return ()
        return P.bad_word_ids(await self.tokenizer.encode_batch.remote(P.bad_word_variants(req.bad_words), False))

    async def output_parser(self, req: P.ChatCompletionRequest, plan: ToolPlan | None, prompt_text: str,
                            constrained: bool):
        """How each choice's text becomes content / reasoning_content / tool_calls (None: all content)."""
        model_reasons = (await self.tokenizer_info())["reasoning"] or self.config.reasoning_parser == "think"
        return output_parser_factory(req, plan, prompt_text, model_reasons and self.config.reasoning_parser != "none",
                                     constrained)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, P.CompletionRequest)
        await self.select_model(req.model, req.lora_path)
        lora = self.adapters.resolve(req.model, req.lora_path)
        raw_prompts = P.completion_prompts(req)
        guided = guided_spec(req)
        seqs = check_request(self.config, req, len(raw_prompts), guided)
        P.check_supported(req)
        info = await self.info()
        prompts: list[list[int]] = []
        texts: list[str] = []
        if req.suffix is not None and not (await self.tokenizer_info())["has_fim_tokens"]:
            raise APIError(400, "this model has no fill-in-the-middle tokens, so `suffix` cannot be used",
                           param="suffix")
        # Every text prompt in one round trip to the tokenizer (a handle call costs far more than encoding).
        strs = [p for p in raw_prompts if isinstance(p, str)] if req.suffix is None else []
        encoded = iter(await self.tokenizer.encode_batch.remote(strs) if strs else [])
        for p in raw_prompts:
            if req.suffix is not None:
                if not isinstance(p, str):
                    raise APIError(400, "suffix needs text prompts, not token ids", param="suffix")
                prompts.append(await self.tokenizer.encode_fim.remote(p, req.suffix))
                texts.append(p)
            elif isinstance(p, str):
                prompts.append(next(encoded))
                texts.append(p)
            else:  # ids: each must exist before echo decodes them (the tokenizer fails or drops others)
                check_token_list(list(p), (await self.tokenizer_info())["vocab_size"], "prompt")
                prompts.append(list(p))
                texts.append(await self.tokenizer.decode.remote(list(p), False) if req.echo else "")
        for i, p in enumerate(prompts):  # "" on a model without BOS: nothing for the model to continue
            if not p:
                raise APIError(400, f"prompt {i} is empty: it encodes to no tokens", param="prompt")
            kept = P.truncate_prompt(p, req.truncate_prompt_tokens, info["max_model_len"])
            if len(kept) < len(p):  # echo repeats what the model was given
                prompts[i] = kept
                texts[i] = await self.tokenizer.decode.remote(kept, False) if req.echo else ""
        vocab = (await self.tokenizer_info())["vocab_size"]
        # Each prompt is validated against the context on its own; the strictest sets max_tokens.
        params = min(
            (P.to_sampling_params(req, prompt_len=len(p),
                                  max_model_len=check_tokens(self.config, req, len(p), "prompt", info["max_model_len"]))
             for p in prompts),
            key=lambda s: s.max_tokens,
        )
        check_sampling(self.config, req, seqs, params.max_tokens, vocab, prompts)
        params = replace(params, cache_salt=cache_salt(owner, req.cache_salt),  # per tenant (block_manager)
                         tenant=owner or None,  # scheduler.max_running_share
                         bad_words_token_ids=await self.bad_words(req))
        rid = f"cmpl-{uuid.uuid4().hex}"
        best_of = req.best_of if req.best_of is not None and req.best_of > (req.n or 1) else None
        if best_of is not None and req.stream:
            raise APIError(400, "best_of > n cannot be streamed (the best choices are known only at the end)",
                           param="best_of")
        greq = GenerateRequest(rid, prompts, params, P.stop_options(req), n=req.n or 1,
                               echo_texts=texts if req.echo else None, guided=guided, best_of=best_of,
                               lora=lora[0], lora_path=lora[1],
                               trace_id=request_id_of(request))
        fmt = self.openai_format(CompletionFormat, greq, req, GenerationState(greq.n, legacy_logprobs=True))
        return await self.run(greq, fmt, req)

    async def tokenizer_info(self) -> dict:
        return await self.routes.current.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        req = await parse(request, P.TokenizeRequest)
        await self.select_model(req.model)
        if req.messages is not None:
            check_chat_template(self.config, req.chat_template)
            plan = plan_tools(req.as_chat(), other_constraint=False)  # the tools as chat's template sees them
            _, ids = await self.render(
                [m.model_dump(exclude_none=True) for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=plan.template_tools if plan is not None else None,
            )
        else:
            ids = await self.tokenizer.encode.remote(req.prompt or "", req.add_special_tokens)
        info = await self.info()
        strs = {"token_strs": await self.tokenizer.token_pieces.remote(ids)} if req.return_token_strs else {}
        return JSONResponse({"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids} | strs)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        self.check_auth(request)
        req = await parse(request, P.DetokenizeRequest)
        await self.select_model(req.model)
        check_token_list(req.tokens, (await self.tokenizer_info())["vocab_size"])
        return JSONResponse({"prompt": await self.tokenizer.decode.remote(req.tokens, False)})

