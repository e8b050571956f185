"""The ingress's per-owner in-flight cap (rayllm/serve/owner_limits.py) on real ServerConfigs and the model
deployment's real Serve options; the 429 through the ingress's own error handler, parsed by the OpenAI SDK."""

from __future__ import annotations

import asyncio
import gc

import httpx
import openai
import pytest
from fastapi import FastAPI, Request

from rayllm.protocol.errors import APIError
from rayllm.schema.config import EngineConfig, SchedulerConfig
from rayllm.serve.config import ServerConfig
from rayllm.serve.owner_limits import (
    LLM_MAX_ONGOING_REQUESTS,
    LLM_MAX_QUEUED_REQUESTS,
    OwnerLimits,
    RateLimited,
    owner_cap,
    released,
)
from rayllm.serve.routes import http_app


def shared(share: float, **options) -> ServerConfig:
    return ServerConfig(engine=EngineConfig(scheduler=SchedulerConfig(max_running_share=share)),
                        llm_deployment_options=options)


def test_the_cap_is_the_share_of_the_model_deployments_queue():
    from rayllm.serve.llm_server import LLMDeployment

    serve_options = LLMDeployment._deployment_config
    assert (LLM_MAX_ONGOING_REQUESTS, LLM_MAX_QUEUED_REQUESTS) == (serve_options.max_ongoing_requests,
                                                                 serve_options.max_queued_requests)
    name = ServerConfig().served_model_name
    assert OwnerLimits.of(ServerConfig()).caps == {}  # max_running_share 1: off
    assert OwnerLimits.of(shared(0.5)).caps == {name: 384}  # ceil(0.5 x (256 + 512))
    assert OwnerLimits.of(shared(0.1, max_ongoing_requests=8, max_queued_requests=4)).caps == {name: 2}
    assert owner_cap(0.01, {"max_ongoing_requests": 8, "max_queued_requests": -1}) == 1  # unbounded queue, >= 1


async def test_an_owner_past_its_cap_is_429_until_its_requests_end():
    limits = OwnerLimits({"m": 2, "free": None}, retry_after_s=2.4)
    a1, a2 = limits.enter("m", "a"), limits.enter("m", "a")
    with pytest.raises(RateLimited) as info:
        limits.enter("m", "a")
    err = info.value
    assert (err.status_code, err.type, err.code, err.headers) == (429, "rate_limit_error", "rate_limit_exceeded",
                                                                  {"Retry-After": "2"})
    b = limits.enter("m", "b")  # another key is not held back
    for _ in range(5):
        limits.enter("m", None)  # no key (keys off): never capped, as in the engine
        limits.enter("free", "a")  # a model without max_running_share
    a1()
    a1()  # a second release (error path after the end) frees nothing more
    a3 = limits.enter("m", "a")
    with pytest.raises(RateLimited):
        limits.enter("m", "a")
    for release in (a2, a3, b):
        release()
    assert not limits.in_flight


async def test_a_stream_holds_its_slot_until_it_ends_or_the_client_leaves():
    limits = OwnerLimits({"m": 1}, retry_after_s=1)
    closed: list[str] = []

    async def events(name: str):
        try:
            for i in range(3):
                yield f"{name}{i}"
                await asyncio.sleep(0)
        finally:
            closed.append(name)  # the model call is cancelled here (Generation.events)

    whole = released(events("whole"), limits.enter("m", "a"))
    assert [e async for e in whole] == ["whole0", "whole1", "whole2"]
    assert not limits.in_flight and closed == ["whole"]
    left = released(events("left"), limits.enter("m", "a"))
    assert await anext(left) == "left0"
    with pytest.raises(RateLimited):
        limits.enter("m", "a")
    await left.aclose()  # what Starlette does when the client disconnects
    assert closed == ["whole", "left"] and not limits.in_flight
    never = released(events("never"), limits.enter("m", "a"))  # the client left before the first write
    with pytest.raises(RateLimited):
        limits.enter("m", "a")
    del never
    gc.collect()
    assert not limits.in_flight
    limits.enter("m", "a")


async def test_the_429_is_openai_shaped():
    app = FastAPI()
    app.add_exception_handler(APIError, http_app._api_error)
    limits = OwnerLimits({"m": 1}, retry_after_s=3)
    limits.enter("m", "a")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        limits.enter("m", "a")

    sdk = openai.AsyncOpenAI(api_key="k", base_url="http://test/v1", max_retries=0, http_client=httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"))
    with pytest.raises(openai.RateLimitError) as info:
        await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "rate_limit_exceeded" and info.value.response.headers["retry-after"] == "3"
