"""Prometheus metrics with vLLM's names, so vLLM dashboards work unchanged.

Each metric is recorded twice: through `ray.util.metrics` (exported by Ray's metrics agent when the
cluster runs one, as `ray_vllm_...`: Ray adds `ray_` and takes no `:`) and into a process-local `prometheus_client` registry that
the ingress serves as `GET /metrics` (works without Ray's exporter, e.g. in tests).

Per-request histograms and counters are recorded in the ingress (it sees every delta of every request);
the engine gauges (running / waiting requests, KV-cache usage, prefix-cache hit rate) come from the
model replicas' `stats()`: each replica publishes its own to Ray, and `/metrics` asks one replica per scrape.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rayllm.protocol.choice_state import GenerationState

log = logging.getLogger("ray.serve")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so the dashboards' quantiles mean the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

LABELS = ("model_name",)

# name -> (kind, help, extra labels, buckets)
SPECS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "vllm:time_to_first_token_seconds": ("histogram", "Time to first token in seconds.", (), TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("histogram", "Time per output token (after the first) in seconds.",
                                           (), TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", "End to end request latency in seconds.", (), E2E_BUCKETS),
    "vllm:prompt_tokens": ("counter", "Number of prefill tokens processed.", (), ()),
    "vllm:generation_tokens": ("counter", "Number of generation tokens processed.", (), ()),
    # Finished requests by the request's `model` (the base model or a LoRA adapter) and how they ended
    # (stop, length, abort, error): per-adapter request counts are sum by (model_name).
    "vllm:request_success": ("counter", "Count of finished requests, by model and finish reason.",
                             ("finished_reason",), ()),
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches.", (), ()),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed.", (), ()),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage.", (), ()),
    "vllm:gpu_prefix_cache_hit_rate": ("gauge", "Prefix cache block hit rate (since start).", (), ()),
}

ENGINE_GAUGES = {  # metric name -> key of LLMServer.stats()
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_prefix_cache_hit_rate": "prefix_hit_rate",
}


def ray_metric_name(name: str) -> str:
    """Ray is dropping `:` from metric names (a FutureWarning now): `vllm:x` -> `vllm_x`, which Ray's exporter
    then shows as `ray_vllm_x` (as vLLM's own Ray metrics do)."""
    return name.replace(":", "_")


class _RayMetrics:
    """The same metrics through ray.util.metrics; absent (no-ops) outside a Ray worker."""

    def __init__(self) -> None:
        self.m: dict[str, Any] = {}
        try:
            import ray
            from ray.util import metrics as rm

            if not ray.is_initialized():
                return
            for name, (kind, doc, extra, buckets) in SPECS.items():
                keys = LABELS + extra
                ray_name = ray_metric_name(name)
                if kind == "histogram":
                    self.m[name] = rm.Histogram(ray_name, doc, boundaries=list(buckets), tag_keys=keys)
                elif kind == "counter":
                    # prometheus_client appends _total to counters; Ray does not: name it as vLLM's exporter shows it.
                    self.m[name] = rm.Counter(ray_name + "_total", doc, tag_keys=keys)
                else:
                    self.m[name] = rm.Gauge(ray_name, doc, tag_keys=keys)
        except Exception:  # metrics must never take the server down
            log.warning("Ray metrics unavailable", exc_info=True)
            self.m = {}

    def record(self, name: str, value: float, tags: dict[str, str]) -> None:
        metric = self.m.get(name)
        if metric is None:
            return
        kind = SPECS[name][0]
        if kind == "histogram":
            metric.observe(value, tags=tags)
        elif kind == "counter":
            if value > 0:
                metric.inc(value, tags=tags)
        else:
            metric.set(value, tags=tags)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # our own: no clash with any library's default registry
        self.prom: dict[str, Any] = {}
        for name, (kind, doc, extra, buckets) in SPECS.items():
            keys = list(LABELS + extra)
            if kind == "histogram":
                self.prom[name] = Histogram(name, doc, keys, buckets=buckets, registry=self.registry)
            elif kind == "counter":
                self.prom[name] = Counter(name, doc, keys, registry=self.registry)
            else:
                self.prom[name] = Gauge(name, doc, keys, registry=self.registry)
        self.ray = _RayMetrics()

    def record(self, name: str, value: float, model: str, **extra: str) -> None:
        tags = {"model_name": model, **extra}
        kind = SPECS[name][0]
        m = self.prom[name].labels(**tags)
        if kind == "histogram":
            m.observe(value)
        elif kind == "counter":
            m.inc(value)
        else:
            m.set(value)
        self.ray.record(name, value, tags)

    def set_engine_stats(self, stats: dict, model: str) -> None:
        for name, key in ENGINE_GAUGES.items():
            if key in stats:
                self.record(name, float(stats[key]), model)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def first_token(self, model: str, seconds: float) -> None:
        self.record("vllm:time_to_first_token_seconds", seconds, model)

    def request_done(self, state: GenerationState, model: str, t0: float, outcome: str) -> None:
        """A request's latencies and token counts, from its state, when it ends (`outcome`: its finish
        reason, "abort" when the client left, "error")."""
        end = time.monotonic()
        self.record("vllm:prompt_tokens", float(state.prompt_tokens), model)
        self.record("vllm:generation_tokens", float(state.completion_tokens), model)
        self.record("vllm:e2e_request_latency_seconds", end - t0, model)
        longest = max((c.completion_tokens for c in state.choices.values()), default=0)
        if state.first_token_at is not None and longest > 1:
            self.record("vllm:time_per_output_token_seconds", (end - state.first_token_at) / (longest - 1), model)
        self.record("vllm:request_success", 1.0, model, finished_reason=outcome)


_metrics: ServerMetrics | None = None


def server_metrics() -> ServerMetrics:
    """One set per process (Prometheus metrics must be registered once)."""
    global _metrics
    if _metrics is None:
        _metrics = ServerMetrics()
    return _metrics


def publish_engine_stats(owner: Any, model: str, interval_s: float = 5.0) -> threading.Thread:
    """In a model replica: push `owner.stats()` (its engine gauges) to Ray's metrics every interval.

    A daemon thread holding only a weak reference, so the replica object can still be collected.
    """
    metrics = server_metrics()
    ref = weakref.ref(owner)

    def loop() -> None:
        while True:
            obj = ref()
            if obj is None:
                return
            try:
                metrics.set_engine_stats(obj.stats(), model)
            except Exception:  # the engine may be shutting down; try again later
                log.debug("engine stats unavailable", exc_info=True)
            del obj
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="engine-metrics", daemon=True)
    thread.start()
    return thread
