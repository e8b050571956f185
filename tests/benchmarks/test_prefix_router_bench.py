"""prefix_router_bench's time-to-first-token phases (--trace): spans exported by OpenTelemetry's own OTLP/HTTP
exporter into tracing_bench's sink, read back and split into the bench's phases."""

from __future__ import annotations

import threading

import pytest

from benchmarks.prefix_router_bench import PHASES, phases
from benchmarks.serve_stats import percentile
from benchmarks.tracing_bench import Sink


@pytest.fixture
def sink():
    s = Sink()
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield s
    s.shutdown()


def export(sink: Sink, trace_id: int, times: dict[str, tuple[int, int]]) -> None:
    """One request's spans, with the given (start, end) in ns, through the SDK's OTLP/HTTP exporter."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
        endpoint=f"http://127.0.0.1:{sink.server_port}/v1/traces")))
    parent = set_span_in_context(NonRecordingSpan(SpanContext(trace_id, 1, True, TraceFlags(1))))
    tracer = provider.get_tracer("test")
    for name, (start, end) in times.items():
        tracer.start_span(name, context=parent, start_time=start).end(end_time=end)
    provider.shutdown()


def test_phases_from_exported_spans(sink):
    ms = 1_000_000
    # two requests: the second without engine spans (a failed request) counts only where its spans exist
    a = {"POST /v1/chat/completions": (0, 900 * ms), "llm.generate": (20 * ms, 880 * ms),
         "engine.queue": (150 * ms, 160 * ms), "engine.prefill": (160 * ms, 610 * ms)}
    b = {"POST /v1/chat/completions": (0, 50 * ms), "llm.generate": (40 * ms, 45 * ms)}
    export(sink, 0xA, a)
    export(sink, 0xB, b)
    spans = sink.spans()
    assert {(s["trace"], s["name"]) for s in spans} == (
        {(f"{0xA:032x}", n) for n in a} | {(f"{0xB:032x}", n) for n in b})
    got = phases([{"trace": f"{0xA:032x}"}, {"trace": f"{0xB:032x}"}], spans)
    assert set(got) == set(PHASES)
    assert got["ingress"]["n"] == 2 and got["to_engine"]["n"] == 1
    assert (got["ingress"]["p50_ms"], got["ingress"]["p90_ms"]) == (
        round(percentile([0.02, 0.04], 50) * 1e3, 1), round(percentile([0.02, 0.04], 90) * 1e3, 1))
    assert (got["to_engine"]["p50_ms"], got["queue"]["p50_ms"], got["prefill"]["p50_ms"]) == (130.0, 10.0, 450.0)
