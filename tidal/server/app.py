"""The FastAPI application: routes of both APIs, auth, errors in each API's shape, health and metrics.

`create_app` takes an AsyncEngine, or any object with its interface (`generate`, `tokenizer`, and
optionally `check_request`, `max_model_len`, `metrics`, `is_alive`): tests inject a scripted fake to
drive tool calls and reasoning end to end.
"""
from __future__ import annotations

import json
import logging
import secrets
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.engine.async_engine import EngineError
from tidal.errors import TidalError
from tidal.server import anthropic, metrics, openai, responses
from tidal.server.errors import APIError, body_for, from_exception, validation_message
from tidal.server.sse import ClientGone
from tidal.server.state import ServerState

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)


class APIKeyMiddleware:
    """Require the key as `Authorization: Bearer KEY` or `x-api-key: KEY` (either works on every route,
    so one client config serves both APIs). Pure ASGI: a BaseHTTPMiddleware would wrap streaming
    responses and hide client disconnects from them."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "invalid or missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`")
        body = json.dumps(body_for(scope["path"], err)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer " and \
                    secrets.compare_digest(value[7:].strip(), self.key):
                return True
            if name == b"x-api-key" and secrets.compare_digest(value.strip(), self.key):
                return True
        return False


def create_app(async_engine: Any, served_model_name: str, api_key: Optional[str] = None, *,
               tool_parser: str = "auto", reasoning_parser: str = "auto", keepalive_s: float = 5.0) -> FastAPI:
    state = ServerState.build(async_engine, served_model_name, api_key, tool_parser, reasoning_parser, keepalive_s)
    app = FastAPI(title="Tidal", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tidal = state
    log.info("serving %s; tool parser: %s; reasoning parser: %s", served_model_name,
             state.tool_parser or "none", state.reasoning_parser or "none")
    for module in (openai, responses, anthropic):
        app.include_router(module.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = getattr(async_engine, "is_alive", True)
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def get_metrics() -> PlainTextResponse:
        snap = async_engine.metrics() if hasattr(async_engine, "metrics") else {}
        return PlainTextResponse(metrics.render(snap, served_model_name), media_type=metrics.CONTENT_TYPE)

    def reply(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(body_for(request.url.path, err), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            # A body without a JSON content type is not parsed (a browser cannot send one cross-site
            # without a CORS preflight, which keeps web pages away from a local server).
            return reply(request, APIError(400, "send the request body as JSON with `Content-Type: application/json`"
                                                f" (got {ctype or 'no content type'!r})"))
        message, param = validation_message(errors)
        return reply(request, APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return reply(request, APIError(exc.status_code, message))

    @app.exception_handler(ClientGone)
    async def on_gone(request: Request, exc: ClientGone) -> JSONResponse:
        return JSONResponse({}, status_code=499)   # nobody reads it; the request was aborted

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        if err.status >= 500:
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return reply(request, err)

    # Known kinds go through Starlette's ExceptionMiddleware (answered, not re-raised); the catch-all
    # Exception handler runs in ServerErrorMiddleware, which answers and then lets uvicorn log the bug.
    for kind in (APIError, TidalError, EngineError, Exception):
        app.add_exception_handler(kind, on_error)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app
