"""Where a request's time to first token goes, from the app's own OpenTelemetry spans (priority_bench.py).

A small OTLP/HTTP receiver in the benchmark process collects the spans of requests that sent a sampled
`traceparent` (the app's `sample_ratio: 0` leaves every other request untraced). For each such request,
with the client's send and first-content times (the same wall clock: one machine):

    to_engine   send -> the engine's arrival stamp (HTTP, ingress, template render, routing, replica, pipe)
    queue       arrival -> first scheduled (includes the step in flight when it arrived)
    first_step  first scheduled -> first token (the step, or steps, that computed its prompt)
    back        first token -> the client's first content delta (replica, ingress, HTTP)
"""

from __future__ import annotations

import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(ThreadingHTTPServer):
    """POST /v1/traces (protobuf): the engine spans' (start, end) by trace id and name."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: dict[str, dict[str, tuple[int, int]]] = {}
        self.lock = threading.Lock()
        reply = ExportTraceServiceResponse().SerializeToString()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                req = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                receiver.spans.setdefault(s.trace_id.hex(), {})[s.name] = (
                                    s.start_time_unix_nano, s.end_time_unix_nano)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}/v1/traces"

    def breakdown(self, sent: dict[str, tuple[int, int]], wait_s: float = 10.0) -> list[dict[str, float]]:
        """Per traced request (trace id -> client send and first-content time.time_ns()), the phases in ms."""
        deadline = time.time() + wait_s
        while True:
            with self.lock:
                ready = [t for t in sent if {"engine.queue", "engine.prefill"} <= set(self.spans.get(t, {}))]
            if len(ready) == len(sent) or time.time() > deadline:
                break
            time.sleep(0.2)
        out = []
        for t in ready:
            send, first = sent[t]
            queue, prefill = self.spans[t]["engine.queue"], self.spans[t]["engine.prefill"]
            out.append({"to_engine": (queue[0] - send) / 1e6, "queue": (queue[1] - queue[0]) / 1e6,
                        "first_step": (prefill[1] - prefill[0]) / 1e6, "back": (first - prefill[1]) / 1e6})
        return out


def traceparent() -> tuple[str, str]:
    """A new sampled W3C traceparent and its trace id."""
    trace_id = uuid.uuid4().hex
    return trace_id, f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
