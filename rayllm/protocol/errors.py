"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        # Any other 4xx (405, 409, 422...) is the client's too; 5xx the server's.
        self.type = type or _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep every field when Ray pickles the exception across processes (the default keeps only args).
        return (_rebuild, (self.status_code, self.message, self.type, self.param, self.code))

    def __repr__(self) -> str:
        return f"APIError({self.status_code}, {self.message!r}, param={self.param!r}, code={self.code!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _rebuild(status_code: int, message: str, type: str, param: str | None, code: str | int | None) -> APIError:
    return APIError(status_code, message, type=type, param=param, code=code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, reason: str) -> APIError:
    """A parameter that parses but that this server cannot honour (yet)."""
    return APIError(400, f"`{param}` is not supported: {reason}", param=param, code="unsupported_parameter")


def unauthorized(message: str = "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                 code: str | None = "invalid_api_key") -> APIError:
    return APIError(401, message, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def model_not_found(model: str | None, available: Sequence[str] = ()) -> APIError:
    """A `model` no route serves (naming the models there are, when the caller lists them)."""
    listed = f" Available models: {', '.join(available)}" if available else ""
    return APIError(404, f"The model `{model}` does not exist.{listed}", param="model", code="model_not_found")


def replica_failed(detail: str) -> APIError:
    """A model replica (its engine, or the replica itself) died under a request: a clear, retryable 503."""
    return APIError(503, f"The model replica serving this request failed ({detail}); it is being replaced, "
                    "retry the request.", type="server_error", code="model_replica_failed")


def server_error(message: str = "internal server error", code: str | None = None) -> APIError:
    return APIError(500, message, code=code)


# Pydantic puts union branch names into `loc` ("str", "list[str]", "tagged-union[...]", model class names);
# they mean nothing to a client, so they are left out of the reported field path.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes", "tuple", "set"})


def _field_path(loc: Sequence[Any]) -> list[str]:
    parts: list[str] = []
    for i, p in enumerate(loc):
        if isinstance(p, str):
            if (i == 0 and p == "body") or p in _TYPE_TAGS or "[" in p or "-" in p or p[:1].isupper():
                continue
            if parts and parts[-1] == p:  # a tagged union repeats the tag, e.g. image_url.image_url
                continue
        parts.append(str(p))
    return parts


def _pick(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first field's error; among its union branches, the deepest (the branch the client meant), and at
    one depth a value's bound over a type mismatch (ids past int32: not "should be a valid string")."""
    first = errors[0]
    top = _field_path(first.get("loc", ()))[:1]
    same = [e for e in errors if _field_path(e.get("loc", ()))[:1] == top]
    return max(same, key=lambda e: (len(_field_path(e.get("loc", ()))), not str(e.get("type", "")).endswith("_type")))


def from_validation_error(exc: ValidationError | Sequence[dict[str, Any]]) -> APIError:
    """A 400 naming the offending field, from pydantic's ValidationError or its (or FastAPI's) error list."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    if not errors:
        return APIError(400, "invalid request", code="invalid_value")
    err = _pick(errors)
    path = _field_path(err.get("loc", ()))
    param = ".".join(path) or None
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param,
                        code="unsupported_parameter")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if err.get("type") == "missing":
        code = "missing_required_parameter"
    else:
        code = "invalid_value"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code=code)
