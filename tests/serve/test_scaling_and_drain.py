"""Autoscaling and graceful drain on real Ray Serve and the real model: an app that scales 1 -> 2
model replicas under load and back, and open streams that finish while their app is redeployed
(rolling update) or deleted.

Runs after test_operations.py, whose apps are gone by then, so the scaled app has CPUs to grow into.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.serve.ops_apps import SMALL_ENGINE, chat_body, deploy

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
