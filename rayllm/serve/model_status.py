"""Model deployments' state as Ray Serve's controller reports it, so that the ingress can answer /health,
/metrics and /v1/models without calling into (and so waking) a model replica scaled to zero, and can wait a
bounded time for a sleeping model to wake before it dispatches a request.

A call through a deployment handle to a deployment with no replica makes Serve start one (scale from
zero); so anything that must not wake a model reads `ServeModelStatus` instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rayllm.protocol.errors import APIError

log = logging.getLogger("ray.serve")

# Serve statuses in which the deployment is where its autoscaler wants it, or on its way there: a model
# with no running replica in one of these is asleep (min_replicas 0), not down.
SETTLED = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})


@dataclass(frozen=True)
class DeploymentState:
    status: str  # Serve's DeploymentStatus name; "MISSING" when the controller does not list it
    running: int  # replicas in RUNNING state

    @property
    def asleep(self) -> bool:
        return self.running == 0 and self.status in SETTLED

    @property
    def healthy(self) -> bool:
        """Serves requests now, or is asleep and will be woken by one. Any running replica serves, whatever
        the deployment's status: Serve says UNHEALTHY while one of several replicas is being replaced, and
        UPDATING while a new version starts beside the old."""
        return self.running > 0 or self.status in SETTLED


def _read_serve_status() -> dict:
    """The controller's instance details as it sends them (a dict). Not `serve.status()`, which validates them
    into pydantic models first: there each deployment's RequestRouterConfig cloudpickles its router's module by
    value, ~20 ms of CPU a read against ~1 ms for the dict (docs/benchmarks.md, serving CPU)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.get_serve_details() if client is not None else {}


def _name(value: Any) -> str:
    return str(getattr(value, "value", value))  # Serve's enums, or their names


def states_of(details: dict, app_name: str) -> dict[str, DeploymentState]:
    """{deployment name: state} of one application in the controller's instance details."""
    app = (details.get("applications") or {}).get(app_name)
    if app is None:
        return {}
    return {name: DeploymentState(_name(d["status"]), sum(_name(r["state"]) == "RUNNING" for r in d.get("replicas", ())))
            for name, d in app["deployments"].items()}


class ServeModelStatus:
    """The controller's view of this app's deployments, read at most every `ttl_s` (probes and scrapes may
    come many times a second; each read is one controller call, made in a thread); while a deployment is not
    healthy (starting, failing) at most every `unhealthy_ttl_s`, so a probe sees it come up without a
    second's lag."""

    def __init__(self, app_name: str, ttl_s: float = 1.0, read: Callable[[], Any] = _read_serve_status,
                 unhealthy_ttl_s: float = 0.2, read_timeout_s: float = 10.0) -> None:
        self.app_name, self.ttl_s, self._read = app_name, ttl_s, read
        self.unhealthy_ttl_s, self.read_timeout_s = unhealthy_ttl_s, read_timeout_s
        self._states: dict[str, DeploymentState] = {}
        self._at = -float("inf")
        self._reading: asyncio.Future | None = None  # the one controller read in flight, shared by its waiters
        self._refresh: asyncio.Task | None = None

    async def states(self, fresh: bool = False) -> dict[str, DeploymentState]:
        """The deployments' states, read again when stale; a read the controller does not answer within
        `read_timeout_s` is a 503 for the caller (the read goes on, and the next caller waits for it)."""
        settled = bool(self._states) and all(s.healthy for s in self._states.values())
        if not fresh and time.monotonic() - self._at <= (self.ttl_s if settled else self.unhealthy_ttl_s):
            return self._states
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_states())
        try:
            return await asyncio.wait_for(asyncio.shield(self._reading), self.read_timeout_s)
        except TimeoutError:
            raise APIError(503, f"Serve's controller did not answer within {self.read_timeout_s:g} s; retry later",
                           type="server_error", code="model_unavailable") from None

    async def _read_states(self) -> dict[str, DeploymentState]:
        try:
            self._states = states_of(await asyncio.to_thread(self._read), self.app_name)
            self._at = time.monotonic()
            return self._states
        finally:
            self._reading = None

    async def state(self, deployment: str, fresh: bool = False) -> DeploymentState:
        return (await self.states(fresh)).get(deployment, DeploymentState("MISSING", 0))

    async def for_request(self, deployment: str) -> DeploymentState:
        """A request's read before it dispatches. A model the last read saw running and healthy is taken as
        still so, and a stale read is renewed in the background: a controller call would cost the request
        tens of milliseconds (more under load; docs/benchmarks.md). Anything else (asleep, starting, missing)
        is read as `state` reads it, so a sleeping model's wake-up stays bounded. A model that fell asleep
        since the last read is seen by the renewal; a request meanwhile wakes it through its handle."""
        cached = self._states.get(deployment)
        if cached is None or cached.running == 0 or not cached.healthy:
            return await self.state(deployment)
        if self._refresh is None and time.monotonic() - self._at > self.ttl_s:
            self._refresh = asyncio.create_task(self._renew())
        return cached

    async def _renew(self) -> None:
        try:
            await self.states()
        except Exception as exc:  # the next request's read tries again
            log.debug("reading Serve's status failed: %s", exc)
        finally:
            self._refresh = None


def model_waking(model: str, waited_s: float, retry_after_s: float) -> APIError:
    err = APIError(503, f"The model '{model}' was scaled to zero and is starting; it was not ready within "
                        f"{waited_s:g} s. Retry after the time given in the Retry-After header.",
                   type="server_error", code="model_waking")
    err.headers = {"Retry-After": str(max(1, round(retry_after_s)))}
    return err


async def wake(model: str, state: DeploymentState, call: Callable[[], Awaitable[Any]], timeout_s: float,
               retry_after_s: float) -> Any:
    """For a sleeping model, `call()` (a unary call to its deployment, which makes Serve start a replica)
    awaited at most `timeout_s`; beyond it a 503 model_waking with Retry-After. An awake model: None."""
    if not state.asleep:
        return None
    t0 = time.monotonic()
    log.info("model %s is scaled to zero: waking it (waiting up to %g s)", model, timeout_s)
    try:
        result = await asyncio.wait_for(call(), timeout=timeout_s)
    except TimeoutError:
        raise model_waking(model, timeout_s, retry_after_s) from None
    log.info("model %s woke in %.2f s", model, time.monotonic() - t0)
    return result
