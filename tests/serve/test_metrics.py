"""The metrics module (no Ray): vLLM's names in Prometheus text, per-request recording, config bounds."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.serve.config import ServerConfig
from rayllm.serve.metrics import ENGINE_GAUGES, ServerMetrics, combine_engine_stats


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _delta(index: int, tokens: int, total: int, finish: str | None = None) -> GenerationDelta:
    return GenerationDelta(index=index, text="x" * tokens, token_ids=[1] * tokens, logprobs=None,
                           finish_reason=finish, matched_stop=None, prompt_tokens=7, cached_tokens=0,
                           completion_tokens=total)


def test_request_metrics_come_from_the_generation_state():
    m = ServerMetrics()
    state = GenerationState(n=2)  # two choices of one prompt
    t0 = time.monotonic() - 0.5
    for d in [_delta(0, 1, 1), _delta(1, 1, 1), _delta(0, 2, 3, "length"), _delta(1, 1, 2, "stop")]:
        state.add(d)
    m.first_token("my-adapter", time.monotonic() - t0)
    m.request_done(state, "my-adapter", t0, state.outcome())
    s = _samples(m)
    label = (("model_name", "my-adapter"),)
    assert s[("vllm:prompt_tokens_total", label)] == 7  # the prompt counts once for its two choices
    assert s[("vllm:generation_tokens_total", label)] == 5
    assert s[("vllm:time_to_first_token_seconds_count", label)] == 1
    assert s[("vllm:time_to_first_token_seconds_sum", label)] >= 0.5
    assert s[("vllm:e2e_request_latency_seconds_count", label)] == 1
    assert s[("vllm:time_per_output_token_seconds_count", label)] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "my-adapter")))] == 1


def test_errors_and_engine_gauges():
    m = ServerMetrics()
    state = GenerationState()
    state.add(_delta(0, 1, 1))
    m.request_done(state, "base", time.monotonic(), "error")
    m.show_engine_stats(combine_engine_stats([
        {"num_running": 1, "num_waiting": 0, "kv_usage": 0.125, "prefix_hit_rate": 0.25, "t": 1.0},
        {"num_running": 2, "num_waiting": 2, "kv_usage": 0.375, "prefix_hit_rate": 0.75, "t": 2.0}]), "base")
    s = _samples(m)
    assert s[("vllm:request_success_total", (("finished_reason", "error"), ("model_name", "base")))] == 1
    assert s[("vllm:num_requests_running", (("model_name", "base"),))] == 3
    assert s[("vllm:num_requests_waiting", (("model_name", "base"),))] == 2
    assert s[("vllm:kv_cache_usage_perc", (("model_name", "base"),))] == 0.25
    assert s[("vllm:gpu_prefix_cache_hit_rate", (("model_name", "base"),))] == 0.5
    # No replica reports (scaled to zero, or gone): the gauges go, rather than stay at their last values.
    m.show_engine_stats(None, "base")
    m.show_engine_stats(None, "never-shown")
    s = _samples(m)
    assert not [k for k in s if k[0] in ENGINE_GAUGES]
    assert s[("vllm:request_success_total", (("finished_reason", "error"), ("model_name", "base")))] == 1


def test_bounds_are_validated():
    with pytest.raises(ValueError, match="max_n"):
        ServerConfig(max_n=-1)
    with pytest.raises(ValueError, match="request_timeout_s"):
        ServerConfig(request_timeout_s=0)
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
        ServerConfig(grammar_compile_timeout_s=0)
    cfg = ServerConfig.from_args({"max_prompt_tokens": 10, "llm_deployment_options": {"max_queued_requests": 4}})
    assert cfg.max_prompt_tokens == 10 and cfg.llm_deployment_options == {"max_queued_requests": 4}


def test_grafana_dashboard_uses_only_metrics_we_export():
    import json
    import re
    from pathlib import Path

    from rayllm.serve.metrics import SPECS, ray_metric_name

    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"vllm:[a-z0-9_]+", e)}
    exported = {n + ("_total" if kind == "counter" else "") for n, (kind, *_) in SPECS.items()}
    assert used and used <= exported, used - exported
    assert exported <= used  # every exported metric has a panel
    for name in used:  # and each panel also reads Ray's exporter, where the names are ray_vllm_...
        assert any("ray_" + ray_metric_name(name) in e for e in exprs), name
