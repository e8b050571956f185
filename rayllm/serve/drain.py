"""The graceful stop's drain at the ingress: new requests get a 503 while the ones in flight run to their end.

Serve's own stop (`serve.delete`) drains the replicas but takes the application's route out of the proxy at
once, so a request arriving meanwhile gets the proxy's plain-text 404 (a client error to SDKs and load
balancers, never retried). So `make serve`'s launcher (rayllm/serve/launch.py) first calls `begin_drain`: a
flag per application in Ray's key-value store. Each ingress replica's watcher (`watch`, a daemon thread)
reads it every WATCH_S and turns its `DrainGate` on: from then on every new HTTP request, /health included
(a load balancer takes the instance out), answers 503 with an OpenAI error body, `Retry-After` and
`Connection: close`. The replica then reports, under its own key, how many admitted requests are still open;
once every ingress replica reported 0 (`open_requests`), the launcher deletes the applications.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from rayllm.protocol.errors import APIError

log = logging.getLogger("ray.serve")

NAMESPACE = "rayllm_drain"  # Ray's key-value store
WATCH_S = 1.0  # how often an ingress replica reads its application's flag (one GCS read)
REPORT_S = 0.2  # while draining: how often it looks at its open requests (a GCS write when the count changed)
SHUTTING_DOWN = "the server is shutting down and takes no new requests; retry on another instance"

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def flag_key(app: str) -> str:
    return f"{app}/draining"


def report_prefix(app: str) -> str:
    return f"{app}/open/"


@dataclass
class DrainState:
    """One ingress replica's gate: whether it drains, and its requests admitted and not yet answered."""

    draining: bool = False
    open: int = 0
    retry_after_s: float = 1.0


STATE = DrainState()  # the replica's (one ingress per process); DrainGate's default


class DrainGate:
    """ASGI middleware: counts the HTTP requests it lets through until their response has been sent; while
    `state.draining`, answers each new one with a 503 instead.

    The count goes up before the flag is read, so a watcher that set the flag and then reads a count of 0
    knows no request is open and none will be admitted."""

    def __init__(self, app: ASGIApp, state: DrainState | None = None) -> None:
        self.app, self.state = app, state or STATE

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = self.state
        state.open += 1
        if state.draining:
            state.open -= 1
            await shutting_down(state.retry_after_s)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            state.open -= 1


def shutting_down(retry_after_s: float) -> JSONResponse:
    """The 503 a draining replica gives new requests: an OpenAI-shaped server error, retryable elsewhere."""
    body = APIError(503, SHUTTING_DOWN, type="server_error", code="server_shutting_down").to_dict()
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(max(1, round(retry_after_s))),
                                                          "Connection": "close"})


def _kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv if internal_kv._internal_kv_initialized() else None


def watch(app: str, replica: str, grace_s: float, state: DrainState = STATE) -> threading.Thread:
    """In an ingress replica: read the application's drain flag every WATCH_S; once it is set, drain and
    report the open requests (with the replica's graceful_shutdown_timeout_s, the launcher's bound) under
    report_prefix(app) + replica whenever their count changes."""

    def loop() -> None:
        reported: int | None = None
        while True:
            try:
                kv = _kv()
                if kv is not None and not state.draining and kv._internal_kv_get(flag_key(app), namespace=NAMESPACE):
                    state.draining = True
                    log.warning("draining: new requests get 503; %d in flight finish first", state.open)
                if kv is not None and state.draining and state.open != reported:
                    now = state.open
                    kv._internal_kv_put(report_prefix(app) + replica, json.dumps({"open": now, "grace_s": grace_s}),
                                        namespace=NAMESPACE)
                    reported = now
            except Exception:  # the GCS busy or going away: try again next time
                log.debug("drain flag not read", exc_info=True)
            time.sleep(REPORT_S if state.draining else WATCH_S)

    thread = threading.Thread(target=loop, name="rayllm-drain", daemon=True)
    thread.start()
    return thread


def begin_drain(apps: list[str]) -> None:
    """From the launcher (a Ray driver): tell every ingress replica of `apps` to drain."""
    kv = _kv()
    for app in apps:
        kv._internal_kv_put(flag_key(app), b"1", namespace=NAMESPACE)


def open_requests(app: str) -> dict[str, dict[str, float]]:
    """The reports of the application's draining ingress replicas: replica id -> {"open", "grace_s"}."""
    kv = _kv()
    reports = {}
    for key in kv._internal_kv_list(report_prefix(app), namespace=NAMESPACE):
        raw = kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw is not None:
            name = key.decode() if isinstance(key, bytes) else key
            reports[name[len(report_prefix(app)):]] = json.loads(raw)
    return reports
