"""Production operation on real Ray Serve and the real model: metrics, request bounds, back-pressure,
request timeout, recovery from a dead tensor-parallel actor, autoscaling and graceful drain.

Apps with special settings are extra named apps (own route prefix) in the session cluster, small
(fp32, a small KV budget, half a CPU per replica), deleted when the module ends.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "SmolLM2-135M-Instruct"
SMALL_ENGINE = {"model": {"dtype": "float32", "max_model_len": 1024},
                "cache": {"kv_cache_bytes": 96 << 20},
                "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}}


def deploy(server: str, name: str, args: dict, wait_s: float = 300) -> str:
    from ray import serve

    from deployments.builder import build_app

    app = build_app({"replica_num_cpus": 0.5, "engine": SMALL_ENGINE} | args)
    serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    base = f"{server}/{name}"
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=15).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"app {name} did not become healthy")


@pytest.fixture(scope="module")
def apps():
    """Names of the extra apps this module deployed; all deleted at the end."""
    from ray import serve

    names: list[str] = []
    yield names
    for name in names:
        try:
            serve.delete(name)
        except Exception:
            pass


def sse_lines(r: httpx.Response) -> list[str]:
    return [ln for ln in r.iter_lines() if ln]


def chat_body(max_tokens: int, stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, **kw}


# ---- metrics -----------------------------------------------------------------------------------------------

def _metric_values(server: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{server}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_endpoint_has_vllm_names_and_counts_requests(server, client, model_name):
    label = (("model_name", model_name),)
    before = _metric_values(server)
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=8)
    chunks = list(client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    after = _metric_values(server)

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


# ---- request bounds, back-pressure, timeout ------------------------------------------------------------------

LIMITS = {"max_prompt_tokens": 64, "max_total_tokens": 512, "max_n": 2, "max_request_bytes": 4096,
          "request_timeout_s": 3, "retry_after_s": 2,
          # One request at a time in the model, one more queued at the ingress: the third is refused.
          "llm_deployment_options": {"max_ongoing_requests": 1, "max_queued_requests": 1}}


@pytest.fixture(scope="module")
def limited(server, apps):
    apps.append("ops-limits")
    return deploy(server, "ops-limits", LIMITS)


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


async def test_backpressure_gives_503_with_retry_after_never_a_hang(limited):
    async with httpx.AsyncClient(timeout=60) as http:
        async def one() -> tuple[int, dict, list[str]]:
            async with http.stream("POST", f"{limited}/v1/chat/completions", json=chat_body(8, stream=True)) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, dict(r.headers), [r.text]
                return 200, dict(r.headers), [ln async for ln in r.aiter_lines() if ln]

        t0 = time.monotonic()
        results = await asyncio.gather(*(one() for _ in range(6)))
        elapsed = time.monotonic() - t0
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    assert elapsed < 30  # refused at once, not queued without bound
    for status, headers, lines in results:
        if status == 503:
            assert headers.get("retry-after") == "2", (headers, lines)
            err = json.loads(lines[0])["error"]
            assert err["code"] == "server_overloaded" and err["type"] == "server_error"
        else:
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_request_timeout_is_an_openai_error(limited):
    # 500 tokens take far longer than the app's 3 s timeout on this CPU.
    t0 = time.monotonic()
    r = httpx.post(f"{limited}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 500,
                                                      "ignore_eos": True}, timeout=60)
    assert r.status_code == 504 and _error(r)["code"] == "request_timeout"
    assert time.monotonic() - t0 < 20
    with httpx.stream("POST", f"{limited}/v1/completions", timeout=60, headers={"X-Request-Id": "trace-timeout-1"},
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        lines = sse_lines(r)
    assert lines[-1] == "data: [DONE]"
    event = json.loads(lines[-2][6:])
    assert event["error"]["code"] == "request_timeout" and event["request_id"] == "trace-timeout-1"
    # The timed-out requests were aborted: the single slot is free again.
    r = httpx.post(f"{limited}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


# ---- failure of a tensor-parallel actor ---------------------------------------------------------------------

def _rank_actors(app: str) -> list[tuple[str, str]]:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"rayllm-tp:{app}:llm:")]


def test_dead_tp_actor_fails_stream_clearly_health_503_then_recovers(server, apps):
    import ray

    apps.append("ops-ray")
    base = deploy(server, "ops-ray", {"engine": SMALL_ENGINE | {"parallel": {"executor": "ray"}},
                                      "llm_deployment_options": {"health_check_period_s": 2}})
    (victim,) = _rank_actors("ops-ray")
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=chat_body(400, stream=True), timeout=120) as r:
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
        h = httpx.get(f"{base}/health", timeout=30)
        saw_503 = h.status_code == 503
        if not saw_503:
            time.sleep(0.5)
    assert saw_503 and h.json()["error"]["type"] == "server_error"
    # Serve replaces the replica (new rank actors) and new requests succeed.
    deadline = time.time() + 240
    while True:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat_body(4), timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text  # never anything but a clear "retry"
        assert time.time() < deadline, "the replica was not replaced"
        time.sleep(2)
    assert r.json()["usage"]["completion_tokens"] == 4
    actors = _rank_actors("ops-ray")
    assert actors and victim not in actors
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200


def _recovered(base: str, deadline_s: float = 240) -> httpx.Response:
    deadline = time.time() + deadline_s
    while True:
        r = httpx.post(f"{base}/v1/chat/completions", json=chat_body(4), timeout=60)
        if r.status_code == 200:
            return r
        assert r.status_code == 503, r.text  # never anything but a clear "retry"
        assert time.time() < deadline, "the replica was not replaced"
        time.sleep(2)


def test_dead_model_replica_fails_stream_clearly_then_recovers(server):
    """The replica process itself dies mid-stream (not just a rank actor)."""
    import ray
    from ray import serve

    base = f"{server}/ops-ray"
    replicas = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::ops-ray#llm#")]
    assert len(replicas) == 1
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=chat_body(400, stream=True),
                          timeout=120) as r:
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
        assert _recovered(base).json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    finally:
        serve.delete("ops-ray")  # frees its CPUs for the autoscaling test


# ---- autoscaling and graceful drain -------------------------------------------------------------------------

SCALE = {"stream_interval_s": 0.05, "llm_deployment_options": {
    "max_ongoing_requests": 4,
    "graceful_shutdown_timeout_s": 60,
    "graceful_shutdown_wait_loop_s": 0.5,
    "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                           "upscale_delay_s": 2, "downscale_delay_s": 6, "metrics_interval_s": 0.5,
                           "look_back_period_s": 2}}}


def _running_llm_replicas(app: str) -> int:
    from ray import serve

    st = serve.status().applications[app].deployments["llm"]
    return st.replica_states.get("RUNNING", 0)


def _llm_replica_actors(app: str) -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#llm#")}


@pytest.fixture(scope="module")
def scaled(server, apps):
    apps.append("ops-scale")
    return deploy(server, "ops-scale", SCALE)


async def test_autoscaling_up_under_load_and_back_down_without_failures(scaled):
    app = "ops-scale"
    assert _running_llm_replicas(app) == 1
    results: list[tuple[int, str | None]] = []
    stop = asyncio.Event()

    async def worker(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            r = await http.post(f"{scaled}/v1/chat/completions", json=chat_body(48))
            results.append((r.status_code, r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text))

    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        workers = [asyncio.create_task(worker(http)) for _ in range(4)]
        while _running_llm_replicas(app) < 2:
            assert time.monotonic() - t0 < 240, "did not scale up"
            await asyncio.sleep(0.5)
        t_up = time.monotonic() - t0
        await asyncio.sleep(3)  # both replicas serve for a while
        stop.set()
        await asyncio.gather(*workers)
    t1 = time.monotonic()
    while _running_llm_replicas(app) > 1 or len(_llm_replica_actors(app)) > 1:
        assert time.monotonic() - t1 < 180, "did not scale down"
        await asyncio.sleep(0.5)
    print(f"\nautoscaling: 1 -> 2 replicas after {t_up:.1f} s of load, back to 1 "
          f"{time.monotonic() - t1:.1f} s after it; {len(results)} requests")
    assert results and all(s == 200 and reason == "length" for s, reason in results), results


class OpenStream(threading.Thread):
    """A streamed chat completion read on a thread; `started` is set at its first event."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started = threading.Event()
        self.status: int | None = None
        self.lines: list[str] = []

    def run(self) -> None:
        body = chat_body(self.max_tokens, stream=True, stream_options={"include_usage": True})
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=180) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        finally:
            self.started.set()

    def check_complete(self) -> None:
        assert self.status == 200 and self.lines[-1] == "data: [DONE]", self.lines[-3:]
        events = [json.loads(ln[6:]) for ln in self.lines[:-1]]
        assert not any("error" in e for e in events), events[-2:]
        assert events[-1]["usage"]["completion_tokens"] == self.max_tokens


def _llm_states(app: str) -> dict:
    from ray import serve

    status = serve.status().applications.get(app)
    return dict(status.deployments["llm"].replica_states) if status and "llm" in status.deployments else {}


def test_in_flight_stream_finishes_while_app_is_redeployed(server, scaled):
    """Graceful drain on a rolling update: the old replicas stop only once the open stream has ended."""
    from ray import serve

    from deployments.builder import build_app

    app = "ops-scale"
    old = _llm_replica_actors(app)
    stream = OpenStream(scaled, 100)
    stream.start()
    assert stream.started.wait(120)
    # A changed argument: a new version of the ingress and model deployments (a rolling update).
    changed = build_app({"replica_num_cpus": 0.5, "engine": SMALL_ENGINE} | SCALE | {"stream_interval_s": 0.02})
    redeploy = threading.Thread(target=serve.run, args=(changed,), daemon=True,
                                kwargs={"name": app, "route_prefix": f"/{app}", "blocking": False})
    redeploy.start()
    drained_while_streaming = False  # the old model replica was stopping while the stream was open
    while stream.is_alive():
        drained_while_streaming |= bool(_llm_states(app).get("STOPPING")) and stream.is_alive()
        time.sleep(0.1)
    stream.check_complete()
    redeploy.join(240)
    deadline = time.time() + 120
    while _llm_replica_actors(app) & old:  # the old replica goes once drained
        assert time.time() < deadline, "old replica still running"
        time.sleep(0.5)
    assert drained_while_streaming
    r = httpx.post(f"{scaled}/v1/chat/completions", json=chat_body(4), timeout=60)
    assert r.status_code == 200


def test_in_flight_stream_finishes_while_app_is_shut_down(scaled):
    """Graceful drain on shutdown: deleting the app lets the open stream finish before its replicas go."""
    from ray import serve

    app = "ops-scale"
    stream = OpenStream(scaled, 100)
    stream.start()
    assert stream.started.wait(120)
    serve.delete(app, _blocking=False)
    deleting_while_streaming = False  # the app was being deleted (its replicas draining) with the stream open
    while stream.is_alive():
        status = serve.status().applications.get(app)
        deleting_while_streaming |= status is not None and status.status == "DELETING" and stream.is_alive()
        time.sleep(0.1)
    stream.check_complete()
    assert deleting_while_streaming
    deadline = time.time() + 120
    while app in serve.status().applications:
        assert time.time() < deadline, "app not deleted after its stream ended"
        time.sleep(0.5)
