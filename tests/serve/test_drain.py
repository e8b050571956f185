"""DrainGate, the ingress's middleware for make serve's graceful stop: once draining, new requests get a 503 that
the OpenAI SDK reads as a retryable server error, while a request admitted before runs to its end.

A small FastAPI app behind the gate, reached by the OpenAI SDK in process (httpx's ASGI transport). The real
stop (launcher, flag in Ray's key-value store, ingress replicas) is tests/serve/test_stop_leaves_nothing.py.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from rayllm.serve.drain import SHUTTING_DOWN, DrainGate, DrainState


def gated_app(state: DrainState, release: asyncio.Event) -> FastAPI:
    app = FastAPI()
    app.add_middleware(DrainGate, state=state)

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events():
            yield 'data: {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [' \
                  '{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
            await release.wait()  # open until the test lets it finish
            yield 'data: {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [' \
                  '{"index": 0, "text": "b", "finish_reason": "length"}]}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    return app


def clients(app: FastAPI) -> tuple[openai.AsyncOpenAI, httpx.AsyncClient]:
    """The OpenAI SDK on the app, and the same HTTP client for /health."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", max_retries=0, http_client=http), http


async def test_draining_answers_new_requests_503_while_the_open_one_finishes():
    state, release = DrainState(retry_after_s=2.4), asyncio.Event()
    sdk, http = clients(gated_app(state, release))

    async def stream() -> list[str]:
        texts = []
        async for chunk in await sdk.completions.create(model="m", prompt="p", stream=True):
            texts.append((chunk.choices[0].text, chunk.choices[0].finish_reason))
        return texts

    open_stream = asyncio.create_task(stream())
    while state.open == 0:  # admitted: the gate counts it until its last byte is sent
        await asyncio.sleep(0.01)
    state.draining = True
    with pytest.raises(openai.APIStatusError) as refused:
        await sdk.completions.create(model="m", prompt="p", max_tokens=4)
    err = refused.value
    assert isinstance(err, openai.InternalServerError) and err.status_code == 503  # the SDK retries these
    assert err.body == {"message": SHUTTING_DOWN, "type": "server_error", "param": None,
                        "code": "server_shutting_down"}
    assert (err.response.headers["retry-after"], err.response.headers["connection"]) == ("2", "close")
    health = await http.get("/health")  # a load balancer's probe: out of rotation
    assert health.status_code == 503
    assert state.open == 1 and not open_stream.done()  # the refused requests were never counted as open
    release.set()
    assert await asyncio.wait_for(open_stream, 10) == [("a", None), ("b", "length")]
    assert state.open == 0


async def test_requests_pass_and_are_counted_until_answered_when_not_draining():
    state, release = DrainState(), asyncio.Event()
    release.set()
    sdk, http = clients(gated_app(state, release))
    chunks = [c async for c in await sdk.completions.create(model="m", prompt="p", stream=True)]
    assert [c.choices[0].text for c in chunks] == ["a", "b"]
    assert (await http.get("/health")).status_code == 200
    assert state.open == 0
