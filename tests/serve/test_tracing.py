"""rayllm.serve.tracing and tracing_spans in one process, spans collected with the SDK's InMemorySpanExporter:
the config's bounds, the off path, the ASGI middleware on a real FastAPI app (a client's traceparent, a
streamed body, the route's name), and the engine phases the model replica builds from engine timestamps.
The whole app, across its processes, is traced in test_tracing_serving.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rayllm.protocol import protocol as P
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerateRequest, GenerationDelta, StopOptions
from rayllm.schema.outputs import EngineTimings, RequestOutput
from rayllm.schema.sampling_params import SamplingParams
from rayllm.serve import tracing
from rayllm.serve.config import ServerConfig
from rayllm.serve.routes.http_app import parse
from rayllm.serve.tracing import TracingConfig
from rayllm.serve.tracing_spans import TracingMiddleware, model_trace, traced_storage

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans():
    """Tracing on in this process, every finished span kept in memory."""
    exporter = InMemorySpanExporter()
    tracing.configure(TracingConfig(enabled=True), "test", SimpleSpanProcessor(exporter))
    yield exporter
    tracing.shutdown()


def test_config_is_off_by_default_and_bounded():
    assert not ServerConfig().tracing.enabled and not ServerConfig.from_args({}).tracing.enabled
    cfg = ServerConfig.from_args({"tracing": {"enabled": True, "otlp_endpoint": "http://collector:4318/v1/traces",
                                              "sample_ratio": 0.25, "headers": {"authorization": "Bearer x"}}})
    assert cfg.tracing.sample_ratio == 0.25 and cfg.tracing.headers == (("authorization", "Bearer x"),)
    for bad, field in (({"sample_ratio": 1.5}, "sample_ratio"), ({"protocol": "thrift"}, "protocol"),
                       ({"otlp_endpoint": "collector:4318"}, "otlp_endpoint"), ({"enabled": "yes"}, "enabled"),
                       ({"export_interval_s": 0}, "export_interval_s"), ({"endpoint": "x"}, "endpoint"),
                       ({"headers": ["a"]}, "headers")):
        with pytest.raises(ValueError, match=field):
            ServerConfig.from_args({"tracing": bad})


def test_off_everything_is_a_no_op_and_imports_no_opentelemetry():
    tracing.shutdown()
    assert tracing.span("x") is tracing.NULL and tracing.current_span() is None
    with tracing.client_span("render") as traceparent:
        assert traceparent is None
    req = GenerateRequest("r", [[1]], SamplingParams(), StopOptions(), traceparent="00-" + CLIENT_TRACE + "-"
                          + CLIENT_SPAN + "-01")
    assert model_trace(req, "m") is tracing.NULL  # this process has tracing off: the caller's context is ignored

    async def write(state):
        return None

    assert traced_storage(write) is write
    probe = "import sys, rayllm.serve.tracing; print(any(m.startswith('opentelemetry') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def middleware_app() -> FastAPI:
    """A real FastAPI app with the ingress's middleware and body parsing, and a streamed response."""
    app = FastAPI()
    app.add_middleware(TracingMiddleware)
    app.add_exception_handler(APIError, lambda request, exc: JSONResponse(exc.to_dict(), exc.status_code))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, P.CompletionRequest)

        async def body():
            for i in range(3):
                with tracing.span("chunk", i=i):
                    await asyncio.sleep(0.01)
                yield f"data: {req.prompt} {i}\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}

    return app


async def call(app: FastAPI, headers: dict[str, str], body: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.post("/v1/completions", json=body or {"model": "m", "prompt": "hi"}, headers=headers)


async def test_middleware_continues_the_clients_trace_through_a_streamed_body(spans):
    app = middleware_app()
    r = await call(app, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=1"})
    assert r.status_code == 200 and r.text.count("data:") == 3
    by_name: dict[str, list] = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    (root,) = by_name["POST /v1/completions"]
    assert root.kind is SpanKind.SERVER and root.parent.span_id == int(CLIENT_SPAN, 16)
    assert root.context.trace_id == int(CLIENT_TRACE, 16) and root.context.trace_state.get("vendor") == "1"
    assert root.attributes["http.response.status_code"] == 200
    (validate,) = by_name["validate"]
    assert len(by_name["chunk"]) == 3
    for child in [validate, *by_name["chunk"]]:  # the streamed body's spans too: the root ends after it
        assert child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time

    spans.clear()
    r = await call(app, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"})  # the client sampled it out
    assert r.status_code == 200 and spans.get_finished_spans() == ()
    r = await call(app, {}, {"model": "m", "prompt": 3.5})  # no traceparent: a new trace; a 400 from validate
    assert r.status_code == 400
    validate, root = sorted(spans.get_finished_spans(), key=lambda s: s.name != "validate")
    assert root.parent is None and root.attributes["http.response.status_code"] == 400
    assert not validate.status.is_ok and validate.parent.span_id == root.context.span_id
    spans.clear()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/health")).status_code == 200
    assert spans.get_finished_spans() == ()  # health checks are not traced


def test_model_replica_spans_from_engine_timestamps(spans):
    """The replica's span continues the ingress's traceparent; each choice's queue / prefill / decode spans
    carry exactly the engine's timestamps and its token counts."""
    with tracing.span("ingress") as ingress:
        traceparent = tracing.traceparent_of(ingress)
    req = GenerateRequest("chatcmpl-1", [[5, 6, 7]], SamplingParams(max_tokens=4), StopOptions(), n=2,
                          trace_id="xrid", traceparent=traceparent)
    base = 1_700_000_000_000_000_000
    timings = [EngineTimings(base + 10, base + 25, base + 40, base + 90), EngineTimings(base + 10, base + 30, 0,
                                                                                       base + 35)]
    with model_trace(req, "m") as trace:
        for choice, (t, reason, tokens) in enumerate(zip(timings, ("length", "abort"), (4, 0), strict=True)):
            out = RequestOutput("x", [], 3, 1, finished=True, finish_reason=reason, timings=t)
            trace.engine_phases(choice, out, tokens)
            trace.observe([GenerationDelta(choice, "", [], None, reason, None, 3, 1, tokens)])
    got = {(s.name, s.attributes.get("rayllm.choice")): s for s in spans.get_finished_spans()}
    llm, root = got["llm.generate", None], got["ingress", None]
    assert llm.parent.span_id == root.context.span_id and llm.kind is SpanKind.SERVER
    assert llm.attributes["gen_ai.response.id"] == "chatcmpl-1" and llm.attributes["rayllm.x_request_id"] == "xrid"
    assert llm.attributes["gen_ai.usage.input_tokens"] == 3 and llm.attributes["gen_ai.usage.output_tokens"] == 4
    assert llm.attributes["gen_ai.response.finish_reasons"] == ("length", "abort")
    assert got["engine.queue", 0].start_time == base + 10 and got["engine.queue", 0].end_time == base + 25
    assert (got["engine.prefill", 0].start_time, got["engine.prefill", 0].end_time) == (base + 25, base + 40)
    assert (got["engine.decode", 0].start_time, got["engine.decode", 0].end_time) == (base + 40, base + 90)
    assert got["engine.prefill", 0].attributes["rayllm.cached_tokens"] == 1
    assert got["engine.decode", 0].attributes["gen_ai.usage.output_tokens"] == 4
    # choice 1 was aborted after its scheduling, before a token: its prefill ends at the abort and says so
    assert (got["engine.queue", 1].start_time, got["engine.queue", 1].end_time) == (base + 10, base + 30)
    assert (got["engine.prefill", 1].start_time, got["engine.prefill", 1].end_time) == (base + 30, base + 35)
    assert got["engine.prefill", 1].attributes["rayllm.aborted"] == "cancelled" and ("engine.decode", 1) not in got
    assert "rayllm.aborted" not in {**got["engine.queue", 1].attributes, **got["engine.decode", 0].attributes}
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        assert got[name, 0].parent.span_id == llm.context.span_id


async def test_model_span_ends_on_a_failure_with_its_error(spans):
    req = GenerateRequest("r", [[1]], SamplingParams(), StopOptions(),
                          traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    with pytest.raises(RuntimeError), model_trace(req, "m"):
        raise RuntimeError("engine failed: boom")
    (llm,) = spans.get_finished_spans()
    assert not llm.status.is_ok and "boom" in llm.status.description
    assert llm.context.trace_id == int(CLIENT_TRACE, 16)


def test_the_model_span_waits_for_a_stopped_choices_engine_phases(spans):
    """A choice that a stop string ended is aborted in the engine; its phases come with the abort's
    acknowledgement, after the generation ended. The replica's span ends only then, around them: the
    decode span ends at the abort and says why. A choice the engine refused (None) closes nothing more."""
    req = GenerateRequest("cmpl-2", [[5, 6, 7]], SamplingParams(max_tokens=8), StopOptions(stop=("Paris",)), n=3,
                          traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    with model_trace(req, "m") as trace:
        done = trace.choice(0, lambda: (7, None))
        stopped = trace.choice(1, lambda: (3, "Paris"))
        refused = trace.choice(2, lambda: (0, None))
        t0 = time.time_ns()
        done(RequestOutput("a", [9], 3, 0, finished=True, finish_reason="length",
                           timings=EngineTimings(t0 + 1, t0 + 2, t0 + 3, t0 + 4)))
        refused(None)
    assert spans.get_finished_spans()[-1].name == "engine.decode"  # llm.generate is still open
    ack = RequestOutput("b", [], 3, 0, finished=True, finish_reason="abort",
                        timings=EngineTimings(t0 + 1, t0 + 2, t0 + 3, time.time_ns()))
    stopped(ack)
    got = {(s.name, s.attributes.get("rayllm.choice")): s for s in spans.get_finished_spans()}
    llm = got["llm.generate", None]
    assert len(got) == 7  # llm.generate, three phases for each of choices 0 and 1
    assert got["engine.decode", 0].attributes["gen_ai.usage.output_tokens"] == 8  # 7 read, 1 on the last output
    decode = got["engine.decode", 1]
    assert decode.attributes["rayllm.aborted"] == "stop_string" and decode.attributes["gen_ai.usage.output_tokens"] == 3
    assert decode.end_time == ack.timings.finished_ns <= llm.end_time
    for (name, _), s in got.items():
        if name != "llm.generate":
            assert s.parent.span_id == llm.context.span_id and llm.start_time <= s.start_time <= s.end_time
