"""The HTTP server (OpenAI's API, Anthropic's Messages API) over the batched engine (`tandem serve`).

    app.py        create_app(model, engine, options): routes
    state.py      ServerOptions, ServerState (what handlers share; /health's verdict)
    guard.py      ASGI middleware: API key, body size/deadline, 5xx shaping, counting
    transport.py  uvicorn protocol: request-head deadline, connection cap
    prompts.py    chat template + tokenizer off the event loop, time-limited
    jobs.py       request -> engine rows: option checks, SamplingParams per choice
    responses.py  engine rows -> JSON bodies and SSE streams (logprobs, usage, tool calls)
    anthropic.py  Anthropic's Messages API: its request -> the chat request, rows -> its JSON/SSE
    schemas.py    pydantic request/response models (what /openapi.json describes)
    metrics.py    Prometheus text for GET /metrics
    tools.py      tool-call parsing with mlx-lm's parsers
    static/chat.html  the chat page at GET / (vanilla JS over /v1/chat/completions)

Imports go one way: app -> anthropic -> jobs, prompts, guard, responses -> state -> metrics,
tools.

Oracle: tests/test_server.py (a live uvicorn server, the official openai client).
"""

from mlx_tandem.server.app import create_app
from mlx_tandem.server.state import ServerOptions
from mlx_tandem.server.transport import uvicorn_config

__all__ = ["ServerOptions", "create_app", "uvicorn_config"]
