"""Production operation on real Ray Serve and the real model: metrics, request bounds, back-pressure,
request timeout, recovery from a dead tensor-parallel actor or model replica (autoscaling and
graceful drain: test_scaling_and_drain.py).

Apps with special settings are extra named apps (own route prefix) in the session cluster, small
(fp32, a small KV budget, half a CPU per replica), deleted when the module ends. Each test needs only
its fixtures (any one runs alone), and the timing tests size their requests and bounds from a `Pace`
measured through the app when they start, not from fixed seconds.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayllm.serve.metrics import STATS_FRESH_S, STATS_INTERVAL_S, STATS_NAMESPACE, stats_prefix
from tests.serve.ops_apps import MODEL, QUESTION, SMALL_ENGINE, Pace, chat_body, deploy_all, sse_lines

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module's probes and polls: each new one builds an SSL context (~20 ms of CPU)."""
    with httpx.Client(timeout=60) as client:
        yield client


# ---- metrics -----------------------------------------------------------------------------------------------

def _metric_values(server: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{server}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _wait_for_stats_written_after(t0: float) -> None:
    """Until every replica of the session app's model that /metrics counts (a record at most STATS_FRESH_S
    old) has written its engine record (rayllm.serve.metrics) later than `t0` by more than one stats()
    call: those records hold the engine's state after `t0`."""
    from ray.experimental import internal_kv

    deadline = time.monotonic() + STATS_FRESH_S + 2 * STATS_INTERVAL_S  # a gone replica's record ages out
    while True:
        keys = internal_kv._internal_kv_list(stats_prefix("llm", "llm"), namespace=STATS_NAMESPACE)
        stamps = [json.loads(internal_kv._internal_kv_get(k, namespace=STATS_NAMESPACE) or "{}").get("t", 0)
                  for k in keys]
        fresh = [t for t in stamps if time.time() - t <= STATS_FRESH_S]
        if fresh and min(fresh) > t0 + 0.25:
            return
        assert time.monotonic() < deadline, ("no engine record written since the requests", stamps, t0)
        time.sleep(0.1)


def test_metrics_endpoint_has_vllm_names_and_counts_requests(server, client, model_name, llm_stats):
    label = (("model_name", model_name),)
    before = _metric_values(server)
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=8)
    chunks = list(client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    # The engine gauges are the replica's own, written every STATS_INTERVAL_S to Ray's key-value store: a
    # scrape after the next write shows them (not a fixed 1.5 intervals: the record's own time stamp says).
    _wait_for_stats_written_after(time.time())
    after, stats = _metric_values(server), llm_stats()

    def grew(name: str) -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    assert grew("vllm:prompt_tokens_total") == r.usage.prompt_tokens + chunks[-1].usage.prompt_tokens
    assert grew("vllm:generation_tokens_total") == r.usage.completion_tokens + chunks[-1].usage.completion_tokens
    for hist in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert grew(f"{hist}_count") == 2, hist
        assert after[(f"{hist}_sum", label)] > 0
    reasons = {r.choices[0].finish_reason, next(c.choices[0].finish_reason for c in chunks
                                                 if c.choices and c.choices[0].finish_reason)}
    finished = 0.0
    for reason in reasons:  # per model / adapter, by finish reason
        key = ("vllm:request_success_total", (("finished_reason", reason), ("model_name", model_name)))
        finished += after[key] - before.get(key, 0)
    assert finished == 2
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_prefix_cache_hit_rate"):
        assert (gauge, label) in after, gauge
    assert 0 < after[("vllm:gpu_prefix_cache_hit_rate", label)] <= 1  # the same question twice: prefix hits
    assert after[("vllm:num_requests_running", label)] == stats["num_running"] == 0  # idle now
    assert after[("vllm:kv_cache_usage_perc", label)] == pytest.approx(stats["kv_usage"])


# ---- request bounds, back-pressure, timeout ------------------------------------------------------------------

LIMITS = {"max_prompt_tokens": 64, "max_total_tokens": 512, "max_n": 2, "max_request_bytes": 4096,
          "retry_after_s": 2,
          # One request at a time in the model, one more queued at the ingress: the third is refused.
          "llm_deployment_options": {"max_ongoing_requests": 1, "max_queued_requests": 1}}


TIMEOUT_CAP = LIMITS["max_total_tokens"] - 16  # the longest request the timeout test may send


class AppURL(str):
    """An app's base URL, with the request timeout it was deployed with."""

    timeout_s: float


@pytest.fixture(scope="module")
def module_apps(server, apps, auth, fp32_server) -> dict:
    """The module's two apps, deployed together (their replicas start side by side): their URLs, and the
    request timeout of ops-limits (see `limited`), from the pace of the fp32 app (conftest.fp32_server:
    the same model and engine settings as these apps). ops-ray has the same bounds with no request
    timeout, its TP rank as a Ray actor and health checks every 2 s: the back-pressure test's streams
    (which must meet no timeout) and the fault tests share it (one app start fewer than one app each)."""
    pace = Pace(fp32_server, headers=auth)
    timeout_s = max(1.0, round(min(pace.bound(8, margin=6.0), TIMEOUT_CAP * pace.step_s / 4), 1))
    specs = {"ops-limits": LIMITS | {"request_timeout_s": timeout_s},
             "ops-ray": LIMITS | {"engine": SMALL_ENGINE | {"parallel": {"executor": "ray"}},
                                  "llm_deployment_options": LIMITS["llm_deployment_options"]
                                  | {"health_check_period_s": 2}}}
    apps.extend(specs)
    return deploy_all(server, specs) | {"timeout_s": timeout_s}


@pytest.fixture(scope="module")
def limited(module_apps) -> AppURL:
    """The bounds above and a request timeout that ordinary requests clear by far on this machine (6x an
    8-token request, measured on the fp32 app, same model and numerics), so only the timeout test's meet it; and
    at most a quarter of the longest request the bounds allow, so that one outlasts it twice over."""
    url = AppURL(module_apps["ops-limits"])
    url.timeout_s = module_apps["timeout_s"]
    return url


@pytest.fixture(scope="module")
def queue_bound(module_apps) -> str:
    """The same queue bounds with no request timeout (ops-ray): the back-pressure test's long streams must
    not meet one."""
    return module_apps["ops-ray"]


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_request_bounds_are_400_and_413_with_clear_messages(limited):
    url = f"{limited}/v1/chat/completions"
    long_prompt = [{"role": "user", "content": "word " * 100}]
    r = httpx.post(url, json={"model": MODEL, "messages": long_prompt, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and _error(r)["code"] == "prompt_too_long"
    assert "max_prompt_tokens" in _error(r)["message"] and _error(r)["param"] == "messages"
    r = httpx.post(f"{limited}/v1/completions", json={"model": MODEL, "prompt": "word " * 100, "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 400 and _error(r)["code"] == "prompt_too_long" and _error(r)["param"] == "prompt"
    r = httpx.post(url, json=chat_body(600), timeout=60)
    assert r.status_code == 400 and _error(r)["code"] == "max_total_tokens_exceeded"
    assert "512" in _error(r)["message"] and _error(r)["param"] == "max_tokens"
    r = httpx.post(url, json=chat_body(4, n=3), timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "n" and "max_n" in _error(r)["message"]
    r = httpx.post(f"{limited}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 1,
                                                      "best_of": 3}, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "best_of"
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 1}
    r = httpx.post(url, json=big, timeout=60)
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    assert "4096" in _error(r)["message"]
    # Within the bounds, the same app answers.
    r = httpx.post(url, json=chat_body(4), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_request_chat_template_is_off_by_default(limited):
    """An app with the default switches (as cluster.yaml ships) refuses a request's own chat template
    (the session app turns them on to test templates; test_abuse.py tests the bounds when on)."""
    body = chat_body(4) | {"chat_template": "{{ 'x' * 10**9 }}"}
    r = httpx.post(f"{limited}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and _error(r)["param"] == "chat_template"
    assert _error(r)["code"] == "chat_template_not_allowed"


async def test_backpressure_gives_503_with_retry_after_never_a_hang(queue_bound):
    """Six streams at once, one model slot and one queue place: two are served, the rest refused at
    once (each 503 before the first stream could have ended), none left hanging."""
    pace = Pace(queue_bound)
    # Each admitted stream lasts ~40 request times: all six have arrived while the first still runs (each
    # refusal must come within 10 of them, below).
    tokens = pace.tokens_for(40 * pace.request_s, cap=LIMITS["max_total_tokens"] - 64)

    async with httpx.AsyncClient(timeout=2 * pace.bound(tokens)) as http:
        async def one() -> tuple[int, dict, list[str], float]:
            t0 = time.monotonic()
            async with http.stream("POST", f"{queue_bound}/v1/chat/completions", json=chat_body(tokens, stream=True)) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, dict(r.headers), [r.text], time.monotonic() - t0
                return 200, dict(r.headers), [ln async for ln in r.aiter_lines() if ln], time.monotonic() - t0

        t0 = time.monotonic()
        results = await asyncio.gather(*(one() for _ in range(6)))
        elapsed = time.monotonic() - t0
    statuses = sorted(s for s, _, _, _ in results)
    assert 1 <= statuses.count(200) <= 2 and statuses.count(503) == 6 - statuses.count(200), (statuses, pace)
    assert elapsed < 2 * pace.bound(tokens), (elapsed, pace)  # the served ones, one after the other
    for status, headers, lines, took in results:
        if status == 503:
            assert took < 10 * pace.request_s, (took, pace)  # refused at once (the first stream runs ~40 of these)
            assert headers.get("retry-after") == "2", (headers, lines)
            err = json.loads(lines[0])["error"]
            assert err["code"] == "server_overloaded" and err["type"] == "server_error"
        else:
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_request_timeout_is_an_openai_error(limited):
    pace = Pace(limited, tokens=8)  # the app's timeout is sized on 8-token requests: longer ones could meet it
    timeout_s = limited.timeout_s
    tokens = pace.tokens_for(2 * timeout_s, TIMEOUT_CAP)  # twice longer than the app's timeout
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": tokens, "ignore_eos": True}
    late = timeout_s + pace.bound(8)  # the timeout, then the abort and the error's way back
    t0 = time.monotonic()
    r = httpx.post(f"{limited}/v1/completions", json=body, timeout=2 * pace.bound(tokens))
    assert r.status_code == 504 and _error(r)["code"] == "request_timeout"
    assert time.monotonic() - t0 < late, (time.monotonic() - t0, pace)
    t0 = time.monotonic()
    with httpx.stream("POST", f"{limited}/v1/completions", timeout=2 * pace.bound(tokens),
                      headers={"X-Request-Id": "trace-timeout-1"}, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = sse_lines(r)
    assert time.monotonic() - t0 < late, (time.monotonic() - t0, pace)
    assert lines[-1] == "data: [DONE]"
    event = json.loads(lines[-2][6:])
    assert event["error"]["code"] == "request_timeout" and event["request_id"] == "trace-timeout-1"
    # The timed-out requests were aborted: the single slot is free again.
    r = httpx.post(f"{limited}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                   timeout=pace.bound(2))
    assert r.status_code == 200


# ---- failure of a tensor-parallel actor ---------------------------------------------------------------------

def _rank_actors(app: str) -> list[tuple[str, str]]:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"rayllm-tp:{app}:llm:")]


@pytest.fixture(scope="module")
def ops_ray(module_apps) -> str:
    """TP ranks as Ray actors (executor: ray), health checked every 2 s (and the queue bounds of the
    back-pressure test, which runs on it first). Each test that kills part of it waits until Serve has
    replaced it, so the next finds it healthy."""
    return module_apps["ops-ray"]


def test_dead_tp_actor_fails_stream_clearly_health_503_then_recovers(ops_ray, http):
    import ray

    base = ops_ray
    (victim,) = _rank_actors("ops-ray")
    with http.stream("POST", f"{base}/v1/chat/completions", json=chat_body(400, stream=True), timeout=120) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3:  # mid-generation
                ray.kill(ray.get_actor(victim[0], namespace=victim[1]), no_restart=True)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["code"] == "model_replica_failed" and err["type"] == "server_error"
    assert "retry" in err["message"]
    # /health reports it (the failed replica, until Serve has replaced it).
    saw_503 = False
    deadline = time.time() + 60
    while time.time() < deadline and not saw_503:
        h = http.get(f"{base}/health")
        saw_503 = h.status_code == 503
        if not saw_503:
            time.sleep(0.5)
    assert saw_503 and h.json()["error"]["type"] == "server_error"
    # A fixed text: no Ray traceback, actor id or pid reaches the client (the cause is in the ingress log).
    from rayllm.serve.routes.ops_routes import UNHEALTHY

    assert h.json()["error"]["message"] == UNHEALTHY and "Actor" not in h.text and "pid" not in h.text
    # Serve replaces the replica (new rank actors) and new requests succeed.
    assert _recovered(http, base).json()["usage"]["completion_tokens"] == 4
    actors = _rank_actors("ops-ray")
    assert actors and victim not in actors
    assert http.get(f"{base}/health").status_code == 200


def _recovered(http: httpx.Client, base: str, deadline_s: float = 240) -> httpx.Response:
    """The first 200 of a short request, polled until Serve has replaced what was killed."""
    deadline = time.time() + deadline_s
    while True:
        r = http.post(f"{base}/v1/chat/completions", json=chat_body(4))
        if r.status_code == 200:
            return r
        assert r.status_code == 503, r.text  # never anything but a clear "retry"
        assert time.time() < deadline, "the replica was not replaced"
        time.sleep(0.5)


def test_dead_model_replica_fails_stream_clearly_then_recovers(ops_ray, http):
    """The replica process itself dies mid-stream (not just a rank actor)."""
    import ray

    base = ops_ray
    replicas = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::ops-ray#llm#")]
    assert len(replicas) == 1
    with http.stream("POST", f"{base}/v1/chat/completions", json=chat_body(400, stream=True), timeout=120) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 3:
                ray.kill(ray.get_actor(*replicas[0]), no_restart=True)
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["code"] == "model_replica_failed" and "retry" in err["message"]
    assert _recovered(http, base).json()["usage"]["completion_tokens"] == 4
    assert http.get(f"{base}/health").status_code == 200


def test_a_dead_tokenizer_replica_makes_health_503_until_it_is_replaced(ops_ray, http):
    """Every chat request needs the tokenizer deployment: /health covers it as it covers the model."""
    import ray

    base = ops_ray
    (victim,) = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::ops-ray#tokenizer#")]
    assert http.get(f"{base}/health").status_code == 200
    ray.kill(ray.get_actor(*victim), no_restart=True)
    deadline, codes = time.time() + 60, []
    while time.time() < deadline and 503 not in codes:
        codes.append(http.get(f"{base}/health").status_code)
        time.sleep(0.1)
    assert 503 in codes, codes
    assert _recovered(http, base).json()["usage"]["completion_tokens"] == 4
    deadline = time.time() + 60
    while http.get(f"{base}/health").status_code != 200:
        assert time.time() < deadline, "health did not come back after the tokenizer was replaced"
        time.sleep(0.5)
