"""The ingress's FastAPI app: OpenAI-shaped error handlers and request-body parsing."""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from rayllm.protocol import conversations as C
from rayllm.protocol import embeddings as E
from rayllm.protocol import protocol as P
from rayllm.protocol import scores as S
from rayllm.protocol.errors import APIError, from_validation_error
from rayllm.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from rayllm.protocol.responses_api import ResponseCreate
from rayllm.serve.drain import DrainGate
from rayllm.serve.request_guards import body_limit, too_large
from rayllm.serve.tracing import span
from rayllm.serve.tracing_spans import TracingMiddleware

log = logging.getLogger("ray.serve")

# /openapi.json is the ingress's own route (rayllm/serve/routes/ops_routes.py: off with API keys on);
# `app.openapi()` builds the schema in-process either way.
app = FastAPI(title="rayllm-tp", docs_url=None, redoc_url=None, openapi_url=None)
# Here, not in the ingress's constructor: serve.ingress serves a copy of this app made at import. It passes
# requests straight on until the ingress turns tracing on (rayllm.serve.tracing.configure).
app.add_middleware(TracingMiddleware)
# Outermost: while the replica drains (make serve's graceful stop) new requests get a 503 before anything runs.
app.add_middleware(DrainGate)


# Routes parse their bodies by hand (`parse`, for OpenAI-shaped errors), so FastAPI does not see them:
# the OpenAPI schema gets them from the same models here (clients, docs, and the schemathesis fuzz).
# Every POST route, each alias too (tests/serve/test_fuzz.py checks that none is left out).
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": P.ChatCompletionRequest,
    "/v1/completions": P.CompletionRequest,
    "/v1/responses": ResponseCreate,
    "/tokenize": P.TokenizeRequest,
    "/detokenize": P.DetokenizeRequest,
    "/v1/embeddings": E.EmbeddingRequest,
    "/v1/rerank": S.RerankRequest,
    "/v2/rerank": S.RerankRequest,
    "/rerank": S.RerankRequest,
    "/v1/score": S.ScoreRequest,
    "/score": S.ScoreRequest,
    "/v1/conversations": C.ConversationCreate,
    "/v1/conversations/{cid}": C.ConversationUpdate,
    "/v1/conversations/{cid}/items": C.ItemsCreate,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}
OPTIONAL_BODIES = frozenset({"/v1/conversations"})  # an empty body creates an empty conversation


def openapi_with_bodies() -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in REQUEST_BODIES.items():
            op = schema.get("paths", {}).get(path, {}).get("post")
            if op is None:
                continue
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            op["requestBody"] = {"required": path not in OPTIONAL_BODIES, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
    return app.openapi_schema


app.openapi = openapi_with_bodies  # type: ignore[method-assign]


# The bound security.md sets for ids in bodies: the header's id reaches sequence ids, logs, errors and spans.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,256}")


def request_id_of(request: Request) -> str:
    """Serve's proxy forwards the client's X-Request-Id, or one it generated. One that is too long or has other
    characters is replaced by a generated one, kept on the request so that every reader sees the same id."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        given = request.headers.get("x-request-id", "")
        rid = request.state.request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    return rid


def error_response(err: APIError, request: Request | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = err.to_dict()
    if request is not None:  # beside OpenAI's `error` object, as hosted platforms do (seed 002)
        body["request_id"] = request_id_of(request)
    return JSONResponse(body, status_code=err.status_code, headers=headers)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request, getattr(exc, "headers", None))


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Unknown routes and methods: OpenAI's body rather than Starlette's {"detail": ...}.
    return error_response(APIError(exc.status_code, str(exc.detail)), request)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, APIError):  # Ray wraps remote exceptions in a subclass of the original
        return error_response(exc, request)
    log.exception("unhandled error (request %s)", request_id_of(request))
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"), request)


def parse_query(request: Request, model: type[BaseModel]) -> BaseModel:
    """A route's query parameters as `model`; a 400 in OpenAI's shape if they do not fit."""
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def read_body(request: Request) -> bytes:
    """The body, counted while it arrives: a chunked (or lying) body past the limit is a 413 as soon as
    the limit passes, without buffering the rest."""
    limit = body_limit(request)
    declared = request.headers.get("content-length")
    if limit and declared and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)  # before reading it
    if getattr(request, "_body", None) is not None:  # already read (and counted) by an earlier call
        return request._body
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit and size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    request._body = body = b"".join(chunks)  # as Request.body() caches it, for later readers
    return body


# application/json and its structured-syntax kin (application/merge-patch+json, ...)
_JSON_MEDIA = re.compile(r"application/json|[\w.+-]+/[\w.+-]+\+json")


def check_json_content_type(request: Request) -> None:
    """A 415 unless the body is declared JSON: a cross-site POST of text/plain (or with no type) needs no CORS
    preflight, so without this check any web page could start generations on a server without keys."""
    declared = request.headers.get("content-type", "")
    media = declared.split(";", 1)[0].strip().lower()
    if not _JSON_MEDIA.fullmatch(media):
        raise APIError(415, f"Unsupported Content-Type {declared[:100]!r}: send the body as JSON "
                       "(Content-Type: application/json).", param="Content-Type", code="unsupported_media_type")


async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
    with span("validate"):  # the request's trace (rayllm.serve.tracing; nothing while it is off)
        check_json_content_type(request)
        body = await read_body(request)
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors()
            if errors and errors[0].get("type") == "json_invalid":
                raise APIError(400, f"request body is not valid JSON: {errors[0].get('msg')}") from None
            raise from_validation_error(errors) from None

