"""A request's spans (rayllm.serve.tracing has the switch, the config and the primitives).

    POST /v1/chat/completions          ingress, SERVER: a child of the client's traceparent, if it sent one
    ├── validate                       ingress: body read, JSON and schema validation
    ├── render                         ingress, CLIENT: the chat template's render call
    │   └── tokenizer.render           tokenizer replica, SERVER
    ├── llm.generate                   model replica, SERVER: the request's ids, model and token counts
    │   ├── engine.queue               engine: arrival -> first scheduled (one set per choice)
    │   ├── engine.prefill             engine: first scheduled -> first token (chunks and preemptions included)
    │   └── engine.decode              engine: first token -> finished
    │                                  (aborted: the phases reached, the last ending at the abort, `rayllm.aborted`)
    └── storage.write                  ingress: `store` / `conversation` (after the last token)

Everything here is called only where tracing is on (`tracing.enabled()`) or returns at once when it is off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rayllm.protocol.io_struct import GenerateRequest, GenerationDelta
from rayllm.schema.outputs import RequestOutput
from rayllm.serve import tracing

# Requests that get a root span: the API, not health checks, metrics scrapes or the playground page.
_TRACED = ("/v1/", "/tokenize", "/detokenize")


def _traced_path(path: str) -> bool:
    return "/v1/" in path or path.endswith(_TRACED[1:])


class TracingMiddleware:
    """Pure ASGI, so the span covers a streamed body to its last byte: one SERVER span per API request,
    current while the route runs (its `validate`, `render`, ... spans are children)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        tracer = tracing.tracer()
        if tracer is None or scope["type"] != "http" or not _traced_path(scope.get("path", "")):
            return await self.app(scope, receive, send)
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        headers = {k: v for k, v in scope.get("headers", ()) if k in (b"traceparent", b"tracestate")}
        parent = None
        if b"traceparent" in headers:
            state = headers.get(b"tracestate")
            parent = tracing.context_from(headers[b"traceparent"].decode("latin-1"),
                                          state.decode("latin-1") if state else None)
        method = scope.get("method", "")
        span = tracer.start_span(f"{method} {scope.get('path', '')}", context=parent, kind=SpanKind.SERVER,
                                 attributes={"http.request.method": method, "url.path": scope.get("path", "")})
        status = 0

        async def send_traced(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = context.attach(trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            context.detach(token)
            route = scope.get("route")
            if getattr(route, "path", None):  # the route's template: one span name per route, not per id
                span.update_name(f"{method} {route.path}")
            span.set_attribute("http.response.status_code", status)
            if status >= 500 or status == 0:
                span.set_status(Status(StatusCode.ERROR))
            span.end()


def dispatch(greq: GenerateRequest, model: str) -> str | None:
    """At the call to the model: the request's ids on its span; the traceparent the replica continues."""
    span = tracing.current_span()
    if span is None:
        return None
    span.set_attributes({"gen_ai.request.model": model, "gen_ai.response.id": greq.request_id,
                         "rayllm.x_request_id": greq.trace_id, "gen_ai.request.max_tokens": greq.params.max_tokens,
                         "rayllm.n": greq.n})
    return tracing.traceparent_of(span)


def finish_request(span: Any, state: Any, outcome: str) -> None:
    """The request's usage and outcome on its span (`state`: rayllm.protocol.choice_state.GenerationState)."""
    usage = state.usage()
    span.set_attributes({"gen_ai.usage.input_tokens": usage["prompt_tokens"],
                         "gen_ai.usage.output_tokens": usage["completion_tokens"],
                         "rayllm.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                         "gen_ai.response.finish_reasons": [str(c.finish_reason) for c in state.sorted_choices()],
                         "rayllm.outcome": outcome})


def traced_storage(write: Callable[[Any], Awaitable[None]] | None) -> Callable[[Any], Awaitable[None]] | None:
    """`write` (the stream loop's on_complete) inside a `storage.write` span; as is while tracing is off."""
    if write is None or not tracing.enabled():
        return write

    async def traced(state: Any) -> None:
        with tracing.span("storage.write"):
            await write(state)

    return traced


class ModelTrace:
    """The model replica's span of one request (`with`: it ends however the generation ends), and each
    choice's engine phases from the timestamps the engine put on its last output."""

    def __init__(self, req: GenerateRequest, model: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self.n = req.n
        self.span = tracing.tracer().start_span(
            "llm.generate", context=tracing.context_from(req.traceparent), kind=SpanKind.SERVER,
            attributes={"gen_ai.response.id": req.request_id, "rayllm.x_request_id": req.trace_id,
                        "gen_ai.request.model": model, "rayllm.lora": req.lora or "", "rayllm.n": req.n,
                        "rayllm.prompts": len(req.prompts), "gen_ai.request.max_tokens": req.params.max_tokens})
        self.parent = trace.set_span_in_context(self.span)
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.reasons: list[str] = []
        self.open = 0  # choices whose last engine output (their timings) is still to come
        self.ended = False  # the generation is over; with choices open, the span ends with the last of them

    def __enter__(self) -> ModelTrace:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attributes({"gen_ai.usage.input_tokens": self.prompt_tokens,
                                  "gen_ai.usage.output_tokens": self.completion_tokens,
                                  "rayllm.cached_tokens": self.cached_tokens,
                                  "gen_ai.response.finish_reasons": self.reasons})
        if exc is not None and not isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
        elif exc is not None:
            self.span.set_attribute("rayllm.outcome", "abort")  # the client went away
        self.ended = True
        if not self.open:  # else an aborted choice's acknowledgement is on its way: its phases end inside this
            self.span.end()

    def observe(self, batch: list) -> None:
        """Counts from each choice's last delta (a prompt counts once, however many choices share it)."""
        for d in batch:
            if isinstance(d, GenerationDelta) and d.finish_reason is not None:
                self.reasons.append(d.finish_reason)
                self.completion_tokens += d.completion_tokens
                if d.index % self.n == 0:
                    self.prompt_tokens += d.prompt_tokens
                    self.cached_tokens += d.cached_tokens

    def choice(self, index: int, progress: Callable[[], tuple[int, str | None]]) -> Callable[[Any], None]:
        """The engine client's `on_end` for one choice (its last engine output, which an aborted choice gets
        after it stopped reading). `progress()`, read then: the choice's output tokens so far and the stop
        string, if the serving layer matched one and aborted the sequence."""
        self.open += 1

        def on_end(out: RequestOutput | None) -> None:
            self.open -= 1
            try:
                if out is not None:
                    tokens, stop = progress()
                    self.engine_phases(index, out, tokens + len(out.new_token_ids), stop is not None)
            finally:
                if self.ended and not self.open:
                    self.span.end()

        return on_end

    def engine_phases(self, choice: int, out: RequestOutput, completion_tokens: int, stop_string: bool = False) -> None:
        """queue / prefill / decode spans of one choice, from the engine's clock (the same wall clock as this
        process's: the engine runs on this node). An aborted choice has the phases it reached, the last one
        ending at the abort and saying why (`rayllm.aborted`)."""
        t = out.timings
        if t is None:
            return
        tracer = tracing.tracer()
        phases = (("engine.queue", t.arrival_ns, t.scheduled_ns, {}),
                  ("engine.prefill", t.scheduled_ns, t.first_token_ns,
                   {"gen_ai.usage.input_tokens": out.num_prompt_tokens, "rayllm.cached_tokens": out.num_cached_tokens}),
                  ("engine.decode", t.first_token_ns, 0, {"gen_ai.usage.output_tokens": completion_tokens}))
        for name, start, end, attributes in phases:
            if not start:  # a phase it never reached
                break
            attributes = {"rayllm.choice": choice} | attributes
            if not end and out.finish_reason == "abort":  # the last phase it reached, cut short
                attributes["rayllm.aborted"] = "stop_string" if stop_string else "error" if out.error else "cancelled"
            span = tracer.start_span(name, context=self.parent, start_time=start, attributes=attributes)
            span.end(end_time=max(end or t.finished_ns, start))


def model_trace(req: GenerateRequest, model: str) -> Any:
    """The request's ModelTrace when the ingress traces it and this replica has tracing on, else a no-op
    context (whose `as` target is None)."""
    if req.traceparent is None or not tracing.enabled():
        return tracing.NULL
    return ModelTrace(req, model)
