"""Request parsing and request ids (rayllm/serve/routes/http_app.py) through the ingress's own FastAPI error
handlers, on an ASGI app that mounts `parse` as the ingress's routes do; the OpenAI SDK sends the requests
(its own Content-Type) and parses the errors."""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rayllm.protocol import protocol as P
from rayllm.protocol.errors import APIError
from rayllm.serve.routes import http_app


def parsing_app() -> FastAPI:
    app = FastAPI()
    app.add_exception_handler(APIError, http_app._api_error)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        req = await http_app.parse(request, P.CompletionRequest)
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": req.model,
                             "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
                             "request_id": http_app.request_id_of(request)})

    return app


@pytest.fixture
def asgi() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=parsing_app()), base_url="http://test")


async def test_the_openai_sdk_is_parsed_and_other_content_types_are_415(asgi):
    sdk = openai.AsyncOpenAI(api_key="k", base_url="http://test/v1", http_client=asgi)
    r = await sdk.completions.create(model="m", prompt="hi")  # the SDK's own Content-Type: application/json
    assert r.choices[0].text == "ok"
    body = b'{"model": "m", "prompt": "hi"}'
    for ok in ("application/json", "application/json; charset=utf-8", "Application/JSON",
               "application/vnd.api+json"):
        assert (await asgi.post("/v1/completions", content=body, headers={"content-type": ok})).status_code == 200
    # What a web page may send cross-site without a CORS preflight, and nothing at all.
    for bad in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x", "application/jsonp", None):
        r = await asgi.post("/v1/completions", content=body, headers={"content-type": bad} if bad else {})
        assert r.status_code == 415, (bad, r.text)
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "Content-Type",
                                                            "unsupported_media_type")
    with pytest.raises(openai.APIStatusError) as info:  # the SDK sees an OpenAI-shaped error
        await sdk.completions.create(model="m", prompt="hi", extra_headers={"Content-Type": "text/plain"})
    assert info.value.status_code == 415 and info.value.body["code"] == "unsupported_media_type"


async def test_a_request_id_is_used_only_within_the_bound(asgi):
    body = {"model": "m", "prompt": "hi"}
    for given in ("abc-123", "req_1.2:3", "x" * 256, str(uuid.uuid4())):
        r = await asgi.post("/v1/completions", json=body, headers={"x-request-id": given})
        assert r.json()["request_id"] == given
    for given in ("x" * 257, "a b", "id\x7f", "ü".encode(), "a/b", "<script>"):
        r = await asgi.post("/v1/completions", json=body, headers={"x-request-id": given})
        rid = r.json()["request_id"]
        assert rid != given and re.fullmatch(r"[0-9a-f]{32}", rid)
    # An error names the same generated id as every other reader of the request (one id a request).
    r = await asgi.post("/v1/completions", content=b"{}", headers={"x-request-id": "x" * 300})
    assert r.status_code == 415 and re.fullmatch(r"[0-9a-f]{32}", r.json()["request_id"])
