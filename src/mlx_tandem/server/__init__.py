"""OpenAI-compatible HTTP server over the batched speculative engine (`tandem serve`).

    app.py        create_app(model, engine, options): routes, checks, middleware
    responses.py  engine rows -> JSON bodies and SSE streams (logprobs, usage, tool calls)
    schemas.py    pydantic request/response models (what /openapi.json describes)
    metrics.py    Prometheus text for GET /metrics
    tools.py      tool-call parsing with mlx-lm's parsers

Oracle: tests/test_server.py (a live uvicorn server, the official openai client).
"""

from mlx_tandem.server.app import ServerOptions, create_app

__all__ = ["ServerOptions", "create_app"]
