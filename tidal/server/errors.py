"""Errors in each API's own JSON shape.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
Which shape a response gets depends on the route (`/v1/messages...` is Anthropic's), so a client
library always finds the fields it parses.
"""
from __future__ import annotations

from typing import Any, Optional

from tidal.engine.async_engine import EngineError
from tidal.errors import RequestError, TidalError

# HTTP status -> (OpenAI error type, Anthropic error type)
_KINDS = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("invalid_request_error", "not_found_error"),   # OpenAI: type invalid_request_error, a `code` says what
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class APIError(Exception):
    """An error answered with `status`; `param` names the offending request field when known; `code` is
    OpenAI's machine-readable code (`model_not_found`, ...), when there is one."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def from_exception(e: BaseException) -> APIError:
    """Map any exception from request handling to an APIError (tracebacks are logged by the caller)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (RequestError, TidalError)):
        # Tidal's messages name the field; a TidalError that is not a RequestError (no chat template,
        # ...) is still this request that cannot be served, not a crash.
        return APIError(400, str(e))
    if isinstance(e, EngineError):
        return APIError(500, str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def openai_body(err: APIError) -> dict[str, Any]:
    kind = _KINDS.get(err.status, ("server_error" if err.status >= 500 else "invalid_request_error",))[0]
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def anthropic_body(err: APIError) -> dict[str, Any]:
    kind = _KINDS.get(err.status, (None, "api_error" if err.status >= 500 else "invalid_request_error"))[1]
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def body_for(path: str, err: APIError) -> dict[str, Any]:
    return anthropic_body(err) if is_anthropic_path(path) else openai_body(err)


def validation_message(errors: list[dict]) -> tuple[str, Optional[str]]:
    """(message, param) from pydantic/FastAPI validation errors: 'messages.0.role: Input should be ...'."""
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # Union members add their type to the path ('str', 'list[Open]', 'NamedToolChoice'); our field
        # names are lower-case identifiers, so keep those (and list indices).
        loc = [x for x in loc if x.isdigit() or (x.isidentifier() and x[:1].islower()
                                                  and x not in ("str", "int", "float", "bool", "dict", "list"))]
        where = ".".join(loc)
        if e.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({e.get('msg', '')})")
            continue
        if not where and tuple(e.get("loc", ())) == ("body",):   # the body as a whole
            parts.append("the request body is empty: send a JSON object" if e.get("type") == "missing"
                         else f"the request body must be a JSON object ({e.get('msg', 'invalid value')})")
            continue
        param = param or where or None
        parts.append(f"{where}: {e.get('msg', 'invalid value')}" if where else e.get("msg", "invalid request"))
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param
