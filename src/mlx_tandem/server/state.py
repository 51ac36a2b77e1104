"""What the server's handlers share: the options, the model, the engine, metrics, rows in flight.

Owns `ServerOptions` (server-wide sampling defaults as one SamplingParams, limits, keys)
and `ServerState`. The engine is any object with the threaded Engine's surface
(`submit`, `cancel`, `busy`, `config`, `running`, `scheduler`, `stats`, and optionally
`healthy`); the server never imports the engine's implementation. `ServerState.serving`
is what /health reports: not draining, and the engine says it can serve.

Oracle: tests/test_server.py (/health 503 while draining or while the engine is unhealthy;
rows cancelled at the drain timeout).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mlx_tandem.engine.output import TokenBytes
from mlx_tandem.engine.request import RequestHandle
from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.models.loader import LoadedModel
from mlx_tandem.server.metrics import Metrics
from mlx_tandem.server.tools import tool_support


@dataclass
class ServerOptions:
    """Server-wide defaults and limits (mlx_lm.server's flags, plus ours)."""

    model_id: str
    defaults: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=512))
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    allow_request_templates: bool = False  # may chat_template_kwargs carry a chat_template?
    prompt_timeout_s: float = 10.0  # template rendering + tokenization of one request
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # from the request head to the body's last byte
    header_timeout_s: float = 10.0  # from connect (or the previous response) to a full head
    keep_alive_s: float = 5.0
    max_connections: int = 1000
    retry_after_s: int = 1


class ServerState:
    """What the handlers share: model, engine, options, metrics, and the rows in flight."""

    def __init__(self, model: LoadedModel, engine: Any, options: ServerOptions) -> None:
        self.model, self.engine, self.options = model, engine, options
        self.metrics = Metrics(options.model_id)
        self.tools = tool_support(model.tokenizer)
        self.created = int(time.time())
        self.fingerprint = f"mlx-tandem-{version()}"
        self.draining = False
        self._active: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self.token_bytes = TokenBytes(model.tokenizer)  # logprobs' bytes and offsets

    @property
    def serving(self) -> bool:
        return not self.draining and bool(getattr(self.engine, "healthy", True))

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
        """A token's own text; a token holding part of a character is named by its bytes as
        OpenAI names it ("bytes:\\xe6\\x97"), so two such tokens never share a name (the
        keys of top_logprobs)."""
        data = self.token_bytes(token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("mlx-tandem")
    except PackageNotFoundError:
        return "dev"
