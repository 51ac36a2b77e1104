"""The HTTP boundary: API key, body size and read deadline, response counting, error shapes.

`Guard` is the ASGI middleware every request passes first (inside CORS): it checks the
API key (constant-time; `Authorization: Bearer` in any letter case, or Anthropic's
`x-api-key`; every path but /health, / (the chat page) and CORS preflights), reads the whole body before any handler runs — 413 past `max_body_bytes`
(declared or counted as it arrives), 408 when it has not all arrived within
`body_timeout_s` — and counts every response by endpoint and code for /metrics. An
exception escaping a handler becomes a 500 in OpenAI's error shape *here*, inside the
counting, so every 5xx is in /metrics; its message names no internals (the traceback
goes to the log). `install_errors` gives FastAPI's own errors (validation, 404, 405) the
same shape, with `param` naming the field. Paths under a prefix in `shapes` get that
API's error shape instead (/v1/messages: Anthropic's, server/anthropic.py).

Oracle: tests/test_server.py (401/413 and CORS), tests/test_server_hostile.py (408 for a
slow body, 500s counted, lowercase `bearer`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_tandem.server.schemas import ApiError, error_response
from mlx_tandem.server.state import ServerState

log = logging.getLogger("mlx_tandem.server")

# path -> the endpoint label it is counted under (aliases without /v1 count as their /v1 twin)
ENDPOINTS = {
    "/": "/",
    "/v1/chat/completions": "/v1/chat/completions",
    "/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
    "/completions": "/v1/completions",
    "/v1/models": "/v1/models",
    "/models": "/v1/models",
    "/health": "/health",
    "/metrics": "/metrics",
    "/openapi.json": "/openapi.json",
    "/v1/messages": "/v1/messages",
    "/v1/messages/count_tokens": "/v1/messages/count_tokens",
}

PUBLIC = frozenset({"/health", "/"})  # served without the API key (the page asks for it)

# path prefix -> how errors under it are shaped (the default: OpenAI's, `error_response`)
Shapes = dict[str, Callable[[ApiError], JSONResponse]]


def shape_for(shapes: Shapes, path: str) -> Callable[[ApiError], JSONResponse]:
    for prefix, shape in shapes.items():
        if path == prefix or path.startswith(prefix + "/"):
            return shape
    return error_response


def endpoint_label(path: str) -> str:
    path = path.rstrip("/") or "/"
    if path.startswith(("/v1/models/", "/models/")):
        return "/v1/models"
    return ENDPOINTS.get(path, "other")


def _param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as a field path (`messages[0].content`), union tags dropped."""
    parts = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", str(item)) and item not in _TYPE_TAGS:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def install_errors(app: FastAPI, shapes: Shapes | None = None) -> None:
    def shaped(request: Request, err: ApiError) -> JSONResponse:
        return shape_for(shapes or {}, request.url.path)(err)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return shaped(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors() or [{"loc": (), "msg": "invalid request"}]
        first = max(errors, key=lambda e: len(e.get("loc", ())))  # the most specific
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return shaped(
                request,
                ApiError(400, f"Invalid JSON in request body: {detail}", code="invalid_json"),
            )
        param = _param(tuple(first.get("loc", ())))
        why = first["msg"]
        if first.get("type") == "extra_forbidden":  # a field of the API this server lacks, or a typo
            why = "not a field this server supports"
        message = f"{param}: {why}" if param else f"request body: {why}"
        return shaped(request, ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return shaped(
            request, ApiError(err.status_code, str(err.detail), None, kind, None, err.headers)
        )


def _bearer(header: bytes) -> bytes | None:
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Guard:
    """ASGI middleware: API key, body size and deadline, 5xx shaping, response counting."""

    def __init__(self, app: Any, state: ServerState, shapes: Shapes | None = None) -> None:
        self.app, self.state, self.shapes = app, state, shapes or {}
        key = state.options.api_key
        self.expected = key.encode() if key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label = endpoint_label(scope["path"])
        started = False

        async def counted(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.state.metrics.record_http(label, message["status"])
            await send(message)

        async def refuse(err: ApiError) -> None:
            await shape_for(self.shapes, scope["path"])(err)(scope, receive, counted)

        headers = dict(scope["headers"])
        preflight = scope["method"] == "OPTIONS"
        if self.expected is not None and label not in PUBLIC and not preflight:
            given = (_bearer(headers.get(b"authorization", b"")), headers.get(b"x-api-key"))
            if not any(t is not None and hmac.compare_digest(t, self.expected) for t in given):
                return await refuse(
                    ApiError(
                        401,
                        "invalid or missing API key (Authorization: Bearer <key>, or x-api-key)",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                )
        limit = self.state.options.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await refuse(ApiError(400, "invalid Content-Length"))
        too_big = ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        if declared > limit:
            return await refuse(too_big)
        chunks, size, more = [], 0, scope["method"] in ("POST", "PUT", "PATCH")
        deadline = time.monotonic() + self.state.options.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return await refuse(
                    ApiError(
                        408,
                        f"the request body did not arrive within "
                        f"{self.state.options.body_timeout_s:g} s",
                        code="body_timeout",
                    )
                )
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await refuse(too_big)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, counted)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:  # else the stream just ends; its status was counted already
                await refuse(
                    ApiError(
                        500,
                        "the server failed while handling this request (see its log)",
                        None,
                        "server_error",
                        "internal_error",
                    )
                )
