"""The ingress's operational routes: /health, /metrics, and loading and unloading LoRA adapters.

Kept apart from the OpenAI routes (rayllm/serve/ingress.py), which call these with their own state.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle

from rayllm.common.errors import first_line
from rayllm.protocol.errors import APIError
from rayllm.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from rayllm.serve.auth import Access
from rayllm.serve.lora.shared_adapters import SharedAdapters
from rayllm.serve.metrics import CONTENT_TYPE, ServerMetrics, deployment_engine_stats
from rayllm.serve.model_status import DeploymentState, ServeModelStatus
from rayllm.serve.routes.http_app import app, error_response, parse
from rayllm.serve.routes.model_routes import ModelRoutes

log = logging.getLogger("ray.serve")

# /health's only failure body: the cause (a Ray error names actors, pids and hosts) goes to the log.
UNHEALTHY = "model unavailable: a deployment it needs has no healthy replica; retry later"


class HealthLog:
    """/health's log: one line when the set of unhealthy model deployments changes (a load balancer probes
    every few seconds, and a model starts for many seconds: a line per probe would bury everything else)."""

    def __init__(self) -> None:
        self.down: tuple[str, ...] = ()

    def report(self, down: list[str], cause: str = "") -> None:
        now = tuple(down)
        if now == self.down:
            return
        if now:
            log.warning("/health: model deployments not healthy: %s%s", ", ".join(now), cause and f" ({cause})")
        else:
            log.info("/health: every model deployment healthy again (was: %s)", ", ".join(self.down))
        self.down = now


async def health(deployments: list[DeploymentHandle], status: ServeModelStatus, health_log: HealthLog) -> Response:
    """200 when every deployment a request needs (each model's and its tokenizer's) can serve in Serve's own
    status: a replica running, or asleep (scaled to zero; a request wakes it). A deployment that lost one of
    several replicas still serves (degraded, not down). Read from the controller, never by calling a
    replica, so a probe wakes nothing."""
    try:  # bounded: a busy controller must not hold a load balancer's probe
        states = await asyncio.wait_for(status.states(), timeout=10)
        down = [h.deployment_name for h in deployments
                if not states.get(h.deployment_name, DeploymentState("MISSING", 0)).healthy]
        cause = ""
    except Exception as exc:
        down, cause = ["(status unavailable)"], first_line(exc, 500)
    health_log.report(down, cause)
    if down:
        return error_response(APIError(503, UNHEALTHY, type="server_error", code="model_unavailable"))
    return Response(status_code=200)


def openapi(access: Access) -> JSONResponse:
    """The API schema, for local use; with API keys on it maps every route and field for a prober: 404."""
    if access.enabled:
        raise APIError(404, "Not Found")
    return JSONResponse(app.openapi())


async def metrics(request: Request, access: Access, llms: dict[str, DeploymentHandle],
                  server_metrics: ServerMetrics, status: ServeModelStatus) -> Response:
    """Prometheus text format (vLLM's names). The engine gauges of each model combine the records its
    replicas keep in Ray's key-value store (rayllm.serve.metrics): every replica counts, none is called, so
    a model scaled to zero is not woken; a model none of whose replicas reports shows none."""
    access.metrics(request.headers.get("authorization"))

    async def one(model_name: str, llm: DeploymentHandle) -> None:
        try:
            stats = await asyncio.wait_for(asyncio.to_thread(
                deployment_engine_stats, status.app_name, llm.deployment_name), timeout=5)
        except Exception:  # the GCS did not answer: show no engine gauges rather than stale ones
            log.info("engine stats unavailable for /metrics (%s)", model_name, exc_info=True)
            stats = None
        server_metrics.show_engine_stats(stats, model_name)

    await asyncio.gather(*(one(name, llm) for name, llm in llms.items()))
    return Response(server_metrics.render(), media_type=CONTENT_TYPE)


async def load_adapter(request: Request, access: Access, routes: ModelRoutes, shared: SharedAdapters) -> Response:
    """vLLM's route and body: {"lora_name", "lora_path"}, plus `model` (the base model's name or alias;
    default the first model); the adapter is loaded (and checked) on one of that model's replicas now, and
    on its other replicas when requests reach them; every ingress replica serves it (rayllm/serve/lora/
    shared_adapters.py). Admin key; path under that model's lora.allowed_roots."""
    access.admin(request.headers.get("authorization"))
    req = await parse(request, LoadLoRAAdapterRequest)
    route = routes.base(req.model)
    await shared.read()  # the names other replicas loaded or unloaded, for the checks below
    name = routes.check_new_adapter(route, req.lora_name)
    path = route.adapters.allowed(req.lora_path)
    card = await shared.load(route, name, path)
    headers = {"x-replica-id": card["replica_id"]} if card.get("replica_id") else None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain", headers=headers)


async def unload_adapter(request: Request, access: Access, routes: ModelRoutes, shared: SharedAdapters) -> Response:
    """Requests for it get 404 from here on (through other ingress replicas within shared_adapters.FRESH_S);
    the replica holding it aborts its running requests and frees the slot once the engine has dropped them
    (other replicas free theirs by LRU). Without `model`, the adapter is found in whichever model holds it."""
    access.admin(request.headers.get("authorization"))
    req = await parse(request, UnloadLoRAAdapterRequest)
    await shared.read()  # which model has it, when another replica loaded it
    route = routes.holding(req.lora_name) if req.model is None else routes.base(req.model)
    await shared.unload(route, req.lora_name)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
