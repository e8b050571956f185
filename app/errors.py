"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error"}.get(status_code, "server_error")
        self.param = param
        self.code = code

    def __reduce__(self):  # keep the fields when Ray pickles the exception across processes
        return (_rebuild, (self.status_code, self.message, self.type, self.param, self.code))

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _rebuild(status_code, message, type, param, code) -> APIError:
    return APIError(status_code, message, type=type, param=param, code=code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def from_validation_error(errors: list[dict[str, Any]]) -> APIError:
    """A 400 naming the first offending field, from pydantic's (or FastAPI's) error list."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
        return APIError(400, msg, param=param, code="unsupported_parameter")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
