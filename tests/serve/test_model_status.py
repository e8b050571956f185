"""How the ingress reads Serve's status for /health and scale to zero (rayllm.serve.model_status), on instance
details shaped as Serve's controller sends them (Serve's own enums); test_scale_to_zero.py checks the read against
`serve.status()` on the real app, and the end-to-end behaviour."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ray.serve._private.common import DeploymentStatus, ReplicaState

from rayllm.protocol.errors import APIError
from rayllm.serve.model_status import DeploymentState, ServeModelStatus, states_of, wake


def serve_status(**deployments: tuple[DeploymentStatus, dict]) -> dict:
    """The controller's instance details (`get_serve_instance_details`) for app "app", the fields read."""
    deps = {name: {"name": name, "status": st, "message": "",
                   "replicas": [{"state": ReplicaState(state)} for state, n in replicas.items() for _ in range(n)]}
            for name, (st, replicas) in deployments.items()}
    return {"applications": {"app": {"status": "RUNNING", "deployments": deps}}}


def test_states_asleep_and_healthy_from_serve_status():
    st = states_of(serve_status(
        llm=(DeploymentStatus.HEALTHY, {}),  # scaled to zero
        b=(DeploymentStatus.UPSCALING, {"STARTING": 1}),  # waking
        c=(DeploymentStatus.HEALTHY, {"RUNNING": 1}),
        d=(DeploymentStatus.UNHEALTHY, {"RUNNING": 1}),
        e=(DeploymentStatus.UPDATING, {"STARTING": 1}),  # first deploy, not up yet
        f=(DeploymentStatus.UPDATING, {"RUNNING": 1, "STARTING": 1}),  # rolling update
        g=(DeploymentStatus.UNHEALTHY, {"STOPPING": 1, "STARTING": 1}),  # its only replica being replaced
        h=(DeploymentStatus.DEPLOY_FAILED, {}),
    ), "app")
    # A deployment that lost one of its replicas (d) still serves: degraded, not down.
    assert {n: (s.asleep, s.healthy) for n, s in st.items()} == {
        "llm": (True, True), "b": (True, True), "c": (False, True), "d": (False, True), "e": (False, False),
        "f": (False, True), "g": (False, False), "h": (False, False)}
    assert states_of(serve_status(), "other") == {}


async def test_status_is_read_at_most_once_per_ttl():
    reads = []
    status = ServeModelStatus("app", ttl_s=60, read=lambda: reads.append(1) or serve_status(
        llm=(DeploymentStatus.HEALTHY, {"RUNNING": 1})))
    assert (await asyncio.gather(*(status.state("llm") for _ in range(20))))[0].running == 1
    assert len(reads) == 1
    assert (await status.state("missing")).status == "MISSING"
    await status.states(fresh=True)
    assert len(reads) == 2


async def test_a_deployment_not_yet_healthy_is_read_again_sooner():
    """While a model starts, /health reads the status every unhealthy_ttl_s (not every ttl_s), so a probe
    sees it come up without a second's lag; once all are healthy, every ttl_s again."""
    current = [serve_status(llm=(DeploymentStatus.UPDATING, {"STARTING": 1}))]
    reads = []
    status = ServeModelStatus("app", ttl_s=60, unhealthy_ttl_s=0.05, read=lambda: reads.append(1) or current[0])
    assert not (await status.state("llm")).healthy
    current[0] = serve_status(llm=(DeploymentStatus.HEALTHY, {"RUNNING": 1}))
    assert not (await status.state("llm")).healthy  # within unhealthy_ttl_s: the cached read
    await asyncio.sleep(0.06)
    assert (await status.state("llm")).healthy and len(reads) == 2
    current[0] = serve_status(llm=(DeploymentStatus.UNHEALTHY, {"RUNNING": 1}))
    await asyncio.sleep(0.06)
    assert (await status.state("llm")).healthy and len(reads) == 2  # healthy: cached for ttl_s


async def test_a_request_to_a_running_model_never_waits_for_the_controller():
    """for_request (the ingress's read before each dispatch): a model last seen running is served from the
    cache at once, a stale cache is renewed in the background (one read in flight at a time), and once the
    renewal sees the model asleep the next request reads the status itself, so its wake-up stays bounded."""
    release = threading.Event()
    current = [serve_status(llm=(DeploymentStatus.HEALTHY, {"RUNNING": 1}))]
    reads = []

    def read():
        reads.append(1)
        if len(reads) == 2:  # the background renewal: held until released
            release.wait(10)
        return current[0]

    status = ServeModelStatus("app", ttl_s=0.01, read=read)
    assert (await status.for_request("llm")).running == 1  # nothing cached: read, awaited
    current[0] = serve_status(llm=(DeploymentStatus.HEALTHY, {}))  # scaled to zero meanwhile
    await asyncio.sleep(0.02)  # the cache is stale now
    t0 = time.monotonic()
    for _ in range(5):
        assert (await status.for_request("llm")).running == 1  # the cached state, without waiting
    assert time.monotonic() - t0 < 0.5
    await asyncio.sleep(0.05)
    assert len(reads) == 2  # one renewal in flight, however many requests came
    release.set()
    for _ in range(200):
        if status._refresh is None:
            break
        await asyncio.sleep(0.01)
    assert status._refresh is None and len(reads) == 2
    await asyncio.sleep(0.02)  # past ttl_s: a read within it would be the renewal's own, as fresh as any
    state = await status.for_request("llm")
    assert state.asleep and len(reads) == 3  # seen asleep: read, not assumed (wake() then bounds the wait)
    assert (await status.for_request("missing")).status == "MISSING"


async def test_wake_is_bounded_then_503_with_retry_after():
    async def slow_start():  # a replica that takes longer to start than the bound
        await asyncio.sleep(5)

    t0 = time.monotonic()
    with pytest.raises(APIError) as err:
        await wake("m", DeploymentState("HEALTHY", 0), slow_start, timeout_s=0.2, retry_after_s=3)
    assert time.monotonic() - t0 < 2
    assert err.value.status_code == 503 and err.value.code == "model_waking"
    assert err.value.headers == {"Retry-After": "3"}

    async def quick():
        return "up"

    assert await wake("m", DeploymentState("HEALTHY", 0), quick, 1, 1) == "up"
    assert await wake("m", DeploymentState("HEALTHY", 1), slow_start, 0.01, 1) is None  # awake: no call


async def test_a_controller_that_does_not_answer_is_a_503_and_one_read_serves_every_waiter():
    release = threading.Event()
    reads = []

    def read():
        reads.append(1)
        release.wait(10)
        return serve_status(llm=(DeploymentStatus.HEALTHY, {"RUNNING": 1}))

    status = ServeModelStatus("app", read=read, read_timeout_s=0.2)
    t0 = time.monotonic()
    results = await asyncio.gather(*(status.for_request("llm") for _ in range(5)), return_exceptions=True)
    assert time.monotonic() - t0 < 2
    assert all(isinstance(r, APIError) and r.status_code == 503 and r.code == "model_unavailable" for r in results)
    assert len(reads) == 1  # the waiters shared the read in flight; none started another
    release.set()
    for _ in range(200):
        if status._reading is None:
            break
        await asyncio.sleep(0.01)
    assert (await status.for_request("llm")).running == 1 and len(reads) == 1  # the late answer is kept
