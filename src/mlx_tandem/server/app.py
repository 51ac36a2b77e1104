"""The OpenAI-compatible HTTP app (FastAPI) over one running Engine: a drop-in for mlx_lm.server.

    POST /v1/chat/completions, /v1/completions   JSON, or SSE `data: {...}` ... `data: [DONE]`
    POST /v1/messages, /v1/messages/count_tokens  Anthropic's Messages API (server/anthropic.py)
    GET  /v1/models, /v1/models/{id}, /health (and HEAD), /metrics, /openapi.json
    GET  /   the chat page (server/static/chat.html; public, its API calls send the key)
    (/chat/completions, /completions, /models: the same without /v1)

Every choice of every request is one engine row: `n` choices are n rows (seeds seed,
seed+1, ...), and concurrent requests share the engine's cohort. Handlers await each
row's events on the event loop (no thread per row). Prompt building (chat template,
tokenizer) runs on bounded worker threads with a time limit (server/prompts.py).

Checks, all before any engine state changes: connection limits (server/transport.py),
the API key, body size and deadline (server/guard.py), the body's JSON and strict field
types (400 in OpenAI's error shape, `param` naming the field; server/schemas.py),
unsupported options, logit_bias and prompt ids inside the vocabulary, prompt + max_tokens
within the context window, sampling values (server/jobs.py) and queue room (429 +
Retry-After). The `model` field is never used to load anything. A client that
disconnects has its rows cancelled within one engine step. /health is 503 while the
server drains or the engine cannot serve.

Oracle: tests/test_server.py (a live server, the official openai client) and
tests/test_server_hostile.py (the hostile-client probes); the chat page:
tests/test_chat_page.py.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from mlx_tandem.models.loader import LoadedModel
from mlx_tandem.server import anthropic
from mlx_tandem.server import schemas as S
from mlx_tandem.server.guard import Guard, install_errors
from mlx_tandem.server.jobs import build_job, refuse_unsupported
from mlx_tandem.server.metrics import CONTENT_TYPE
from mlx_tandem.server.prompts import PromptWorkers, chat_prompt, text_prompts
from mlx_tandem.server.responses import run_job
from mlx_tandem.server.schemas import ApiError
from mlx_tandem.server.state import ServerOptions, ServerState, version


def create_app(model: LoadedModel, engine: Any, options: ServerOptions) -> FastAPI:
    """The FastAPI app for one model and one running (threaded) engine."""
    state = ServerState(model, engine, options)
    engine.grammars.warm()  # response_format's first request need not wait for it
    workers = PromptWorkers(options.prompt_timeout_s)
    app = FastAPI(
        title="mlx-tandem",
        version=version(),
        description="OpenAI-compatible API over a batched, speculative MLX engine. " + S.SSE_NOTE,
    )
    app.state.tandem = state
    shapes = {anthropic.PREFIX: anthropic.error_response}
    install_errors(app, shapes)
    err = {"model": S.ErrorResponse}
    codes = {400: err, 401: err, 408: err, 413: err, 429: err, 500: err, 503: err}
    sse = {"text/event-stream": {"schema": {"type": "string", "description": S.SSE_NOTE}}}

    @app.post(
        "/v1/chat/completions",
        responses={200: {"model": S.ChatCompletionResponse, "content": sse}, **codes},
    )
    async def chat_completions(body: S.ChatCompletionRequest, request: Request) -> Response:
        refuse_unsupported(body)
        prompt = await chat_prompt(state, workers, body)
        return await run_job(state, request, build_job(state, body, [prompt], chat=True))

    @app.post(
        "/v1/completions",
        responses={200: {"model": S.CompletionResponse, "content": sse}, **codes},
    )
    async def completions(body: S.CompletionRequest, request: Request) -> Response:
        refuse_unsupported(body)
        prompts, texts = await text_prompts(state, workers, body)
        return await run_job(state, request, build_job(state, body, prompts, False, texts))

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
        ok = state.serving
        return JSONResponse(
            {"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503
        )

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: err})
    async def metrics() -> Response:
        return Response(state.metrics.render(engine), media_type=CONTENT_TYPE)

    page = files("mlx_tandem.server").joinpath("static/chat.html").read_text("utf-8")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def chat_page() -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    anthropic.install(app, state, workers)

    hidden = {"include_in_schema": False}
    app.post("/chat/completions", **hidden)(chat_completions)
    app.post("/completions", **hidden)(completions)
    app.get("/models", **hidden)(models)
    app.get("/models/{model_id:path}", **hidden)(model_card)
    app.head("/health", **hidden)(health)

    app.add_middleware(Guard, state=state, shapes=shapes)
    if options.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.cors_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            allow_headers=["*"],  # the OpenAI JS client sends x-stainless-* headers
        )
    return app
