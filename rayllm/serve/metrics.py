"""Prometheus metrics with vLLM's names, so vLLM dashboards work unchanged.

Each metric is recorded twice: through `ray.util.metrics` (exported by Ray's metrics agent when the
cluster runs one, as `ray_vllm_...`: Ray adds `ray_` and takes no `:`) and into a process-local `prometheus_client` registry that
the ingress serves as `GET /metrics` (works without Ray's exporter, e.g. in tests).

Per-request histograms and counters are recorded in the ingress (it sees every delta of every request);
the engine gauges (running / waiting requests, KV-cache usage, prefix-cache hit rate) come from the
model replicas' `stats()`: each replica publishes its own to Ray's exporter, and writes them every
`STATS_INTERVAL_S` to Ray's GCS key-value store, where the ingress reads every replica's at a scrape of
`/metrics` (no call into a replica: a model scaled to zero is not woken, and a busy one is not queued behind).
"""

from __future__ import annotations

import json
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


# Replicas write their engine gauges this often; a record older than STATS_FRESH_S is a replica that is gone
# (stopped, or its node lost) and counts for nothing; one older than STATS_FORGET_S is deleted by the reader.
STATS_INTERVAL_S = 2.0
STATS_FRESH_S = 15.0
STATS_FORGET_S = 600.0
STATS_NAMESPACE = "rayllm-engine-stats"


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
        """A replica's own gauges, to Ray's exporter (one series per replica there)."""
        for name, key in ENGINE_GAUGES.items():
            if key in stats:
                self.ray.record(name, float(stats[key]), {"model_name": model})

    def show_engine_stats(self, stats: dict | None, model: str) -> None:
        """The gauges `/metrics` shows for a model (from `deployment_engine_stats`), or none while no replica
        reports (scaled to zero, or gone): a stale value would read as load that is not there. Not sent to
        Ray's exporter, where each replica reports its own."""
        for name, key in ENGINE_GAUGES.items():
            if stats is not None and key in stats:
                self.prom[name].labels(model_name=model).set(float(stats[key]))
            else:
                try:
                    self.prom[name].remove(model)
                except KeyError:  # never shown
                    pass

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


def stats_prefix(app: str, deployment: str) -> str:
    return f"{app}/{deployment}/"


def _kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv if internal_kv._internal_kv_initialized() else None


def publish_engine_stats(owner: Any, model: str, key: str | None = None,
                         interval_s: float = STATS_INTERVAL_S) -> threading.Thread:
    """In a model replica: push `owner.stats()` (its engine gauges) to Ray's metrics every interval, and under
    `key` (stats_prefix + the replica's id) in Ray's key-value store for the ingress's `/metrics`.

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
                stats = obj.stats()
                metrics.set_engine_stats(stats, model)
                if key is not None and (kv := _kv()) is not None:
                    record = {k: float(stats[k]) for k in ENGINE_GAUGES.values() if k in stats}
                    kv._internal_kv_put(key, json.dumps(record | {"t": time.time()}), namespace=STATS_NAMESPACE)
            except Exception:  # the engine may be shutting down; try again later
                log.debug("engine stats unavailable", exc_info=True)
            del obj
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="engine-metrics", daemon=True)
    thread.start()
    return thread


def forget_engine_stats(key: str) -> None:
    """A replica that stops takes its record with it (a lost one ages out: STATS_FRESH_S)."""
    try:
        if (kv := _kv()) is not None:
            kv._internal_kv_del(key, namespace=STATS_NAMESPACE)
    except Exception:
        log.debug("engine stats record not deleted", exc_info=True)


def combine_engine_stats(records: list[dict]) -> dict | None:
    """One model's gauges from its replicas' records: requests running and waiting summed, the KV-cache
    usage and prefix-cache hit rate as the replicas' mean (one deployment's replicas have equal caches);
    `replicas`: how many reported."""
    if not records:
        return None
    out: dict[str, float] = {"replicas": len(records)}
    for key in ENGINE_GAUGES.values():
        values = [r[key] for r in records if key in r]
        if values:
            out[key] = sum(values) if key in ("num_running", "num_waiting") else sum(values) / len(values)
    return out


def deployment_engine_stats(app: str, deployment: str, now: float | None = None) -> dict | None:
    """The fresh records of a deployment's replicas in Ray's key-value store, combined (None: none reports).
    Blocking (GCS calls): run it in a thread. Deletes records too old to matter."""
    kv = _kv()
    if kv is None:
        return None
    now = time.time() if now is None else now
    records = []
    for key in kv._internal_kv_list(stats_prefix(app, deployment), namespace=STATS_NAMESPACE):
        raw = kv._internal_kv_get(key, namespace=STATS_NAMESPACE)
        try:
            record = json.loads(raw) if raw is not None else None
        except ValueError:
            record = None
        age = now - record["t"] if isinstance(record, dict) and "t" in record else float("inf")
        if age <= STATS_FRESH_S:
            records.append(record)
        elif age > STATS_FORGET_S:
            kv._internal_kv_del(key, namespace=STATS_NAMESPACE)
    return combine_engine_stats(records)
