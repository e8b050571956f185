"""OpenTelemetry traces of requests (issue 38; docs/routing-priority-tracing.md): one trace per request across
the ingress, the tokenizer deployment, the model replica and its engine process.

Off by default (cluster.yaml `tracing.enabled`). Off, every hook here returns at once: `_tracer` is None,
nothing of OpenTelemetry is imported by this module, and no trace context is sent along, so the tokenizer
and the model replica skip theirs too (they trace only requests that arrive with a `traceparent`).

Context crosses processes as a W3C `traceparent` string: the client's header into the ingress
(`TracingMiddleware`), the ingress's span into the render call's keyword arguments and into
`GenerateRequest.traceparent`. The engine process does not export spans: it stamps each request's arrival,
first scheduling, first token and end on its last `RequestOutput` (`EngineTimings`; an aborted request's
last is the abort's acknowledgement, which the engine client hands on after the replica stopped reading,
e.g. on a stop string), and the model replica turns those into the queue / prefill / decode spans
(rayllm.serve.tracing_spans), so the engine loop never pays for spans or an exporter thread.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

PROTOCOLS = {"http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
             "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}
NULL = contextlib.nullcontext()  # reusable: what every span helper returns while tracing is off


@dataclass(frozen=True)
class TracingConfig:
    """cluster.yaml's `tracing:` block."""

    enabled: bool = False
    # OTLP collector: http/protobuf posts to this URL (a collector's :4318/v1/traces); grpc dials it (:4317).
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    protocol: str = "http/protobuf"
    # Share of new traces kept (by trace id); a client's `traceparent` decides for its own request.
    sample_ratio: float = 1.0
    service_name: str = "rayllm"
    # How often each process sends its finished spans (a batch, off the request path).
    export_interval_s: float = 5.0
    # Extra headers on each export (a collector's auth), as (name, value) pairs.
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"tracing.enabled must be true or false, got {self.enabled!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"tracing.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not isinstance(self.otlp_endpoint, str) or not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError(f"tracing.otlp_endpoint must be an http:// or https:// URL, got {self.otlp_endpoint!r}")
        if isinstance(self.sample_ratio, bool) or not isinstance(self.sample_ratio, (int, float)) \
                or not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be a number in [0, 1], got {self.sample_ratio!r}")
        if isinstance(self.export_interval_s, bool) or not isinstance(self.export_interval_s, (int, float)) \
                or not 0 < self.export_interval_s <= 300:
            raise ValueError(f"tracing.export_interval_s must be in (0, 300], got {self.export_interval_s!r}")
        if not isinstance(self.service_name, str) or not self.service_name:
            raise ValueError("tracing.service_name must be a non-empty string")
        if self.enabled:  # fail when the config is read (the deploy), not in every replica
            for module in ("opentelemetry.sdk.trace", PROTOCOLS[self.protocol]):
                if importlib.util.find_spec(module) is None:
                    raise ValueError(f"tracing.enabled needs {module} (pip install 'rayllm-tp[tracing]')")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> TracingConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        if set(d) - known:
            raise ValueError(f"unknown keys in tracing: {sorted(set(d) - known)} (known: {sorted(known)})")
        headers = d.pop("headers", None) or {}
        if not isinstance(headers, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in headers.items()):
            raise ValueError("tracing.headers must map header names to string values")
        return cls(headers=tuple(sorted(headers.items())), **d)


# This process's tracer once `configure` turned tracing on; None = off, and every hook returns at once.
_tracer: Any = None
_provider: Any = None


def configure(config: TracingConfig | None, component: str, processor: Any = None) -> bool:
    """Turn tracing on in this process (an ingress, tokenizer or model replica) when `config` enables it.
    `processor` replaces the OTLP export (tests: the SDK's in-memory exporter). Returns whether it is on."""
    global _tracer, _provider
    if config is None or not config.enabled:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    shutdown()
    resource = Resource.create({"service.name": config.service_name, "rayllm.component": component,
                                "process.pid": os.getpid()})
    # A private provider, not the global one: Ray Serve's own tracing may own that.
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    if processor is None:
        processor = BatchSpanProcessor(_exporter(config), schedule_delay_millis=config.export_interval_s * 1000)
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("rayllm")
    return True


def _exporter(config: TracingConfig) -> Any:
    headers = dict(config.headers) or None
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=config.otlp_endpoint, insecure=config.otlp_endpoint.startswith("http://"),
                    headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.otlp_endpoint, headers=headers)


def shutdown() -> None:
    """Flush and stop this process's tracing (tests; a replica's provider also flushes at exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def tracer() -> Any:
    return _tracer


def traceparent_of(span: Any) -> str | None:
    """The W3C traceparent naming `span` as the parent, or None for an invalid (no-op) span."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from(traceparent: str | None, tracestate: str | None = None) -> Any:
    """An OpenTelemetry context whose parent is `traceparent` (a malformed one starts a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent or ""} | ({"tracestate": tracestate} if tracestate else {})
    return TraceContextTextMapPropagator().extract(carrier)


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager:
    """A child of the current span for the `with` block (nothing while tracing is off)."""
    if _tracer is None:
        return NULL
    return _tracer.start_as_current_span(name, attributes=attributes or None)


@contextlib.contextmanager
def _client(name: str, attributes: dict[str, Any]) -> Iterator[str | None]:
    from opentelemetry.trace import SpanKind

    with _tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes or None) as s:
        yield traceparent_of(s)


def client_span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[str | None]:
    """A span around a call to another deployment; the block gets the traceparent to send along (None: off)."""
    return NULL if _tracer is None else _client(name, attributes)


def remote_span(name: str, traceparent: str | None, **attributes: Any) -> contextlib.AbstractContextManager:
    """The serving side of a call that brought `traceparent`: a child of the caller's span, current for the
    block. Nothing when the caller traced nothing or this process has tracing off."""
    if _tracer is None or traceparent is None:
        return NULL
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(name, context=context_from(traceparent), kind=SpanKind.SERVER,
                                         attributes=attributes or None)


def current_span() -> Any:
    """The current span if it records (a sampled request's), else None (always None while off)."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    s = trace.get_current_span()
    return s if s.is_recording() else None
