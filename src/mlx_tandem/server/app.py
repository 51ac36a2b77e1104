"""The OpenAI-compatible HTTP app (FastAPI) over one running Engine: a drop-in for mlx_lm.server.

    POST /v1/chat/completions, /v1/completions   JSON, or SSE `data: {...}` ... `data: [DONE]`
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /openapi.json

Every choice of every request is one engine row: `n` choices are n rows (seeds seed,
seed+1, ...), and concurrent requests share the engine's cohort. The engine thread
writes each row's events to a blocking queue; a dedicated thread pool turns those
into awaitables, so no stream waits on another's thread.

Checks, all before any engine state changes: the API key (constant-time, every path
but /health), the body size (413), the body's JSON and fields (400 in OpenAI's error
shape, `param` naming the field), logit_bias ids and prompt ids inside the vocabulary,
prompt + max_tokens within the context window (400), the engine's own validation
(400) and queue room (429 + Retry-After). The `model` field is never used to load
anything. A client that disconnects has its rows cancelled within one engine step.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_tandem.engine.request import RequestHandle
from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.engine.scheduler import QueueFull
from mlx_tandem.engine.service import Engine
from mlx_tandem.models.loader import LoadedModel
from mlx_tandem.server import schemas as S
from mlx_tandem.server.metrics import CONTENT_TYPE, Metrics
from mlx_tandem.server.responses import Job, Row, run_job
from mlx_tandem.server.schemas import ApiError, error_response
from mlx_tandem.server.tools import ToolCallStream, tool_support

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


@dataclass
class ServerOptions:
    """Server-wide defaults and limits (mlx_lm.server's flags, plus ours)."""

    model_id: str
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1


class ServerState:
    """What the handlers share: model, engine, options, metrics, and the rows in flight."""

    def __init__(self, model: LoadedModel, engine: Engine, options: ServerOptions) -> None:
        self.model, self.engine, self.options = model, engine, options
        self.metrics = Metrics(options.model_id)
        workers = engine.config.max_rows + engine.config.max_queue + 8
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tandem-rows")
        self.tools = tool_support(model.tokenizer)
        self.created = int(time.time())
        self.fingerprint = f"mlx-tandem-{_version()}"
        self.draining = False
        self._active: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._token_text: dict[int, str] = {}

    def track(self, handles: list[RequestHandle]) -> None:
        with self._lock:
            self._active.update((h.id, h) for h in handles)

    def untrack(self, handles: list[RequestHandle]) -> None:
        with self._lock:
            for h in handles:
                self._active.pop(h.id, None)

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests; after timeout_s cancel the rows still running (any thread)."""
        self.draining = True

        def cancel_rest() -> None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self._active:
                time.sleep(0.05)
            with self._lock:
                for handle in self._active.values():
                    handle.cancel()

        threading.Thread(target=cancel_rest, name="tandem-drain", daemon=True).start()

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.model.tokenizer.decode([token])
        return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-tandem")
    except PackageNotFoundError:
        return "dev"


# --- building engine requests ----------------------------------------------------------------


def chat_prompt(state: ServerState, body: S.ChatCompletionRequest) -> list[int]:
    messages = [_template_message(m) for m in body.messages]
    kwargs = {**state.options.chat_template_args, **(body.chat_template_kwargs or {})}
    if body.tools and body.tool_choice != "none":
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    try:
        return state.model.encode_messages(messages, chat=True, template_kwargs=kwargs)
    except Exception as err:  # the template is data: any failure is the request's
        raise ApiError(400, f"the chat template rejected the request: {err}", "messages") from err


def _template_message(message: S.ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        out["content"] = "".join(part.text for part in content)
    elif content is None:
        out["content"] = ""
    for call in out.get("tool_calls", []):
        args = call["function"].get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # templates that expect text get the text
                call["function"]["arguments"] = json.loads(args)
    return out


def text_prompts(state: ServerState, body: S.CompletionRequest) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        prompts = [state.model.encode_text(p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = [state.model.encode_text(x) if isinstance(x, str) else list(x) for x in p]
    vocab = state.model.graph.vocab_size
    if not prompts or any(not ids for ids in prompts):
        raise ApiError(400, "prompt is empty: need at least one token", "prompt")
    if any(not 0 <= t < vocab for ids in prompts for t in ids):
        raise ApiError(
            400, f"prompt has a token id outside the vocabulary (size {vocab})", "prompt"
        )
    return prompts


def sampling_params(
    state: ServerState,
    body: S.SamplingFields,
    prompt_len: int,
    max_tokens: tuple[str, int | None],
    logprobs: int,
    choice: int,
) -> SamplingParams:
    """One choice's parameters: request fields over server defaults, seeds seed + choice."""
    o, context = state.options, state.model.context_length
    name, explicit = max_tokens
    if explicit is not None:
        if prompt_len + explicit > context:
            raise ApiError(
                400,
                f"prompt ({prompt_len} tokens) + {name} ({explicit}) exceeds the model's "
                f"context window ({context} tokens)",
                name,
            )
        limit = explicit
    else:
        limit = min(o.max_tokens, context - prompt_len)
        if limit < 1:
            raise ApiError(400, f"prompt ({prompt_len} tokens) fills the context window", name)
    vocab = state.model.graph.vocab_size
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab:
            raise ApiError(400, f"logit_bias token {token} is outside the vocabulary", "logit_bias")
        bias[token] = float(value)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > S.MAX_STOP:
        raise ApiError(400, f"at most {S.MAX_STOP} stop strings", "stop")
    context_size = body.presence_context_size or body.frequency_context_size or 20
    try:
        return SamplingParams(
            max_tokens=limit,
            temperature=_pick(body.temperature, o.temperature),
            top_p=_pick(body.top_p, o.top_p),
            top_k=_pick(body.top_k, o.top_k),
            min_p=_pick(body.min_p, o.min_p),
            repetition_penalty=body.repetition_penalty or None,
            repetition_context_size=body.repetition_context_size or 20,
            presence_penalty=body.presence_penalty or None,
            frequency_penalty=body.frequency_penalty or None,
            penalty_context_size=context_size,
            logit_bias=bias,
            seed=None if body.seed is None else body.seed + choice,
            stop=tuple(s for s in stop if s),
            logprobs=logprobs,
            num_draft_tokens=body.num_draft_tokens,
        )
    except ValueError as err:
        found = re.search(r"invalid (\w+)=", str(err))
        raise ApiError(400, str(err), found.group(1) if found else None) from None


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def submit_all(
    state: ServerState, prompts: list[list[int]], params: list[SamplingParams], prefix: str
) -> list[RequestHandle]:
    """Submit every choice; on any refusal cancel the ones already queued and raise."""
    if state.draining:
        raise ApiError(503, "the server is shutting down", None, "server_error", "shutting_down")
    handles: list[RequestHandle] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            handles.append(state.engine.submit(prompt, p, request_id=f"{prefix}-{i}"))
    except QueueFull as err:
        for h in handles:
            h.cancel()
        retry = {"Retry-After": str(state.options.retry_after_s)}
        raise ApiError(429, str(err), None, "rate_limit_error", "queue_full", retry) from None
    except ValueError as err:
        for h in handles:
            h.cancel()
        raise ApiError(400, str(err), "max_tokens" if "max_tokens" in str(err) else None) from None
    state.track(handles)
    for prompt in prompts:
        state.metrics.record_prompt(len(prompt))
    return handles


# --- the app --------------------------------------------------------------------------------------


def build_job(
    state: ServerState, body: S.SamplingFields, prompts: list[list[int]], chat: bool
) -> Job:
    if len(prompts) * body.n > S.MAX_N:
        raise ApiError(400, f"prompts x n is {len(prompts) * body.n}; at most {S.MAX_N}", "n")
    if chat:
        assert isinstance(body, S.ChatCompletionRequest)
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        explicit = body.max_completion_tokens or body.max_tokens
        name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        tools = state.tools if body.tools and body.tool_choice != "none" else None
        echo = [""] * len(prompts) * body.n
    else:
        assert isinstance(body, S.CompletionRequest)
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")
        k, explicit, name, tools = body.logprobs, body.max_tokens, "max_tokens", None
        texts = [state.model.tokenizer.decode(p) if body.echo else "" for p in prompts]
        echo = [t for t in texts for _ in range(body.n)]
    engine_k = 0 if k is None else max(1, k)
    every = [p for p in prompts for _ in range(body.n)]
    params = [
        sampling_params(state, body, len(p), (name, explicit), engine_k, c % body.n)
        for c, p in enumerate(every)
    ]
    prefix = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tool_args = None
    if tools is not None and isinstance(body, S.ChatCompletionRequest) and body.tools:
        tool_args = [t.model_dump(exclude_none=True) for t in body.tools]
    handles = submit_all(state, every, params, prefix)
    rows = [
        Row(i, ToolCallStream(*tools, tool_args) if tools is not None else None)
        for i in range(len(every))
    ]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(chat, prompts, handles, rows, k, echo, body.stream, include_usage, prefix)


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


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors() or [{"loc": (), "msg": "invalid request"}]
        first = max(errors, key=lambda e: len(e.get("loc", ())))  # the most specific
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(
                ApiError(400, f"Invalid JSON in request body: {detail}", code="invalid_json")
            )
        param = _param(tuple(first.get("loc", ())))
        message = f"{param}: {first['msg']}" if param else f"request body: {first['msg']}"
        return error_response(ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return error_response(
            ApiError(err.status_code, str(err.detail), None, kind, None, err.headers)
        )

    @app.exception_handler(Exception)
    async def crashed(_: Request, err: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"{type(err).__name__}: {err}", None, "server_error"))


class Guard:
    """ASGI middleware: API key, body size limit (413), and response codes for /metrics."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.options.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/") or "/"
        label = path if path in ENDPOINTS or path == "/openapi.json" else "other"
        if path.startswith("/v1/models/"):
            label = "/v1/models"

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.state.metrics.record_http(label, message["status"])
            await send(message)

        headers = dict(scope["headers"])
        if self.expected is not None and path != "/health" and scope["method"] != "OPTIONS":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ApiError(
                    401,
                    "invalid or missing API key (Authorization: Bearer <key>)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error_response(err)(scope, receive, counted)
        limit = self.state.options.max_body_bytes
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await error_response(ApiError(400, "invalid Content-Length"))(
                scope, receive, counted
            )
        too_big = ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        if declared > limit:
            return await error_response(too_big)(scope, receive, counted)
        chunks, size, more = [], 0, scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await error_response(too_big)(scope, receive, counted)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, counted)


def create_app(model: LoadedModel, engine: Engine, options: ServerOptions) -> FastAPI:
    """The FastAPI app for one model and one running (threaded) engine."""
    state = ServerState(model, engine, options)
    app = FastAPI(
        title="mlx-tandem",
        version=_version(),
        description="OpenAI-compatible API over a batched, speculative MLX engine. " + S.SSE_NOTE,
    )
    app.state.tandem = state
    _install_errors(app)
    err = {"model": S.ErrorResponse}
    codes = {400: err, 401: err, 413: err, 429: err, 503: err}

    sse = {"text/event-stream": {"schema": {"type": "string", "description": S.SSE_NOTE}}}

    @app.post(
        "/v1/chat/completions",
        responses={200: {"model": S.ChatCompletionResponse, "content": sse}, **codes},
    )
    async def chat_completions(body: S.ChatCompletionRequest, request: Request) -> Response:
        job = build_job(state, body, [chat_prompt(state, body)], chat=True)
        return await run_job(state, request, job)

    app.post("/chat/completions", include_in_schema=False)(chat_completions)

    @app.post(
        "/v1/completions",
        responses={200: {"model": S.CompletionResponse, "content": sse}, **codes},
    )
    async def completions(body: S.CompletionRequest, request: Request) -> Response:
        job = build_job(state, body, text_prompts(state, body), chat=False)
        return await run_job(state, request, job)

    def card() -> dict[str, Any]:
        return {
            "id": options.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "mlx-tandem",
        }

    @app.get("/v1/models", response_model=S.ModelList, responses={401: err})
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get(
        "/v1/models/{model_id:path}", response_model=S.ModelCard, responses={401: err, 404: err}
    )
    async def model_card(model_id: str) -> dict[str, Any]:
        if model_id != options.model_id:
            raise ApiError(
                404, f"model {model_id!r} is not served here", "model", code="model_not_found"
            )
        return card()

    @app.get("/health", response_model=S.Health, responses={503: {"model": S.Health}})
    async def health() -> Response:
        ok = not state.draining
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: err})
    async def metrics() -> Response:
        return Response(state.metrics.render(engine), media_type=CONTENT_TYPE)

    app.add_middleware(Guard, state=state)
    if options.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app
