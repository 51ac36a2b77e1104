"""`tandem serve`: the OpenAI-compatible server, with mlx_lm.server's flags (a drop-in for it).

    tandem serve --model smollm2-135m [--host 127.0.0.1] [--port 8080] [--draft-model ngram]

mlx_lm.server's flags: --model --host --port --draft-model --num-draft-tokens --temp --top-p
--top-k --min-p --max-tokens --chat-template --chat-template-args --log-level (and
--allowed-origins, --decode-concurrency, --prefill-step-size, --prompt-cache-bytes as
aliases of ours; --kv-bits --kv-group-size as spellings of --kv-codec affine<B>). Not taken
(tests/test_serve_cli.py's NOT_OURS says why): --adapter-path --trust-remote-code
--use-default-chat-template --prompt-concurrency --prompt-cache-size
--quantized-kv-start --pipeline. The
sampling defaults are derived from SamplingParams' knobs (the server ones: also the
penalties and --min-tokens-to-keep). Ours: --max-rows --memory-budget --max-queue
--prefix-cache-bytes (earlier prompts' whole prefill chunks kept for reuse, bit-identical;
default: a quarter of the memory the weights and the KV budget leave, 0 turns it off)
--api-key --cors-origin --dtype --draft-depth --max-body-size --drain-timeout, and the
hostile-client limits --max-connections --header-timeout --body-timeout --prompt-timeout
--allow-request-chat-template (off: a request may not carry its own template) --no-warmup (by
default one short request runs before the server listens: engine/service.warm_up). Speculation is on by default (prompt lookup,
`--draft-model ngram`, `--draft-depth adaptive`: rows draft only as deep as their
measured acceptance pays for); `--draft-model none` turns it off.

Checks before anything loads: flag values (JSON of --chat-template-args, sizes, ports,
every sampling default through SamplingParams).

Oracle: tests/test_serve_cli.py (flags and defaults equal mlx_lm.server's own parser's;
SIGTERM drains a real process), tests/test_server_shutdown.py (SIGTERM under load).
Shutdown: the first SIGINT/SIGTERM stops accepting connections and new requests, lets
running rows finish for --drain-timeout seconds, then cancels the rest (their streams end
with finish_reason "abort"); the process exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_tandem.cli.options import (
    add_draft_flags,
    add_engine_flags,
    add_model_flags,
    add_sampling_flags,
    runtime_config,
    sampling_values,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (a drop-in for mlx_lm.server)")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8080, help="port (default: 8080; 0 picks a free one)"
    )
    add_draft_flags(p)
    p.set_defaults(draft_model="ngram", draft_depth="adaptive")  # adaptive: see BENCHMARKS
    add_sampling_flags(p, max_tokens=512, server=True)
    p.add_argument("--chat-template", default="", help="a chat template (text or a file path)")
    p.add_argument(
        "--chat-template-args",
        default="{}",
        help="JSON kwargs for apply_chat_template, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="the server's log level (default %(default)s)")
    add_engine_flags(p)
    p.add_argument("--decode-concurrency", dest="max_rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--prefill-step-size", dest="prefill_chunk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429 (256)")
    p.add_argument(
        "--prefix-cache-bytes",
        "--prompt-cache-bytes",
        dest="prefix_cache_bytes",
        default=None,
        help="bytes of earlier prompts' chunks kept for reuse, e.g. 2G; 0 turns the prefix "
        "cache off (default: $TANDEM_PREFIX_CACHE_BYTES, else auto: a quarter of the memory "
        "the weights and the KV budget leave)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $TANDEM_API_KEY; none)",
    )
    p.add_argument(
        "--cors-origin",
        "--allowed-origins",
        dest="cors_origin",
        action="append",
        default=[],
        help="allow this browser origin (repeatable or comma-separated; default: CORS off)",
    )
    p.add_argument("--max-body-size", default="4M", help="largest request body (default 4M)")
    p.add_argument(
        "--max-connections",
        type=int,
        default=1000,
        help="open connections at most (lowered to fit the descriptor limit)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a complete request head",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request has to send its whole body (then 408)",
    )
    p.add_argument(
        "--prompt-timeout",
        type=float,
        default=10.0,
        help="seconds one request's chat template + tokenization may take (then 400)",
    )
    p.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="let requests carry their own chat_template in chat_template_kwargs",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the start-up request that builds MLX's kernels before the first user's "
        "(on a fresh machine that request otherwise waits ~8 s for them)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds running rows may finish before they are cancelled",
    )
    p.set_defaults(run=run)


def chat_template_args(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"--chat-template-args is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-args must be a JSON object")
    return value


def check_args(args: argparse.Namespace) -> Any:
    """Refuse bad flag values before anything loads; returns the sampling defaults."""
    from mlx_tandem.engine.config import parse_cache_bytes
    from mlx_tandem.engine.sampling import SamplingParams

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for flag in ("drain_timeout", "header_timeout", "body_timeout", "prompt_timeout"):
        if not getattr(args, flag) >= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.prefix_cache_bytes is not None:
        try:
            parse_cache_bytes(args.prefix_cache_bytes)
        except ValueError as err:
            raise ValueError(f"--prefix-cache-bytes: {err}") from None
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    return SamplingParams(**sampling_values(args))


def set_chat_template(tokenizer: Any, template: str) -> None:
    """--chat-template: a template's text, or a file holding one."""
    path = Path(template)
    if len(template) < 4096 and "{" not in template and path.is_file():
        template = path.read_text(encoding="utf-8")
    tokenizer.chat_template = template
    tokenizer.has_chat_template = True


def run(args: argparse.Namespace) -> int:
    from mlx_tandem.engine.config import parse_bytes, parse_cache_bytes

    defaults = check_args(args)
    template_args = chat_template_args(args.chat_template_args)
    max_body = parse_bytes(args.max_body_size)
    origins = tuple(o.strip() for item in args.cors_origin for o in item.split(",") if o.strip())
    config = runtime_config(args)
    if args.max_queue is not None:
        config = config.with_(max_queue=args.max_queue)
    if args.prefix_cache_bytes is not None:
        config = config.with_(prefix_cache_bytes=parse_cache_bytes(args.prefix_cache_bytes))
    elif not os.environ.get("TANDEM_PREFIX_CACHE_BYTES"):
        config = config.with_(prefix_cache_bytes=None)  # on by default here, sized at build
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    check_listen(args.host, args.port)  # before the model loads: a busy port fails at once

    from mlx_tandem.drafters.factory import build_depth, build_drafter
    from mlx_tandem.engine.service import Engine
    from mlx_tandem.models.loader import load
    from mlx_tandem.server import ServerOptions, create_app, uvicorn_config

    model = load(args.model, dtype=args.dtype)
    if args.chat_template:
        set_chat_template(model.tokenizer, args.chat_template)
    drafter = depth = None
    spec = args.draft_model if args.draft_model and args.draft_model.lower() != "none" else None
    if spec:
        depth = build_depth(args.draft_depth, args.num_draft_tokens)
        drafter = build_drafter(spec, model, config, dtype=args.dtype)
    engine = Engine(model, config, drafter=drafter, depth=depth, warm=not args.no_warmup)
    options = ServerOptions(
        model_id=model.name,
        defaults=defaults,
        chat_template_args=template_args,
        allow_request_templates=args.allow_request_chat_template,
        prompt_timeout_s=args.prompt_timeout,
        api_key=args.api_key,
        cors_origins=origins,
        max_body_bytes=max_body,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        max_connections=args.max_connections,
    )
    app = create_app(model, engine, options)
    uv = uvicorn_config(
        app,
        options,
        args.host,
        args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=int(args.drain_timeout) + 5,
        access_log=args.log_level == "DEBUG",
    )
    lines = banner(model.name, spec, args, bool(args.api_key), engine.warm_up_s)
    server = make_server(uv, app.state.tandem, args.drain_timeout, lines)
    code = 0
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        engine.shutdown(drain=False)
    return code


def banner(
    name: str, spec: str | None, args: argparse.Namespace, keyed: bool, warm_s: float = 0.0
):
    """The start-up lines, given the bound port (the URL and a curl line to try)."""

    def lines(port: int) -> str:
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{port}"
        depth = f"{args.draft_depth}, up to" if args.draft_depth == "adaptive" else "fixed"
        speculation = f"{spec}, {depth} {args.num_draft_tokens} tokens" if spec else "off"
        auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if keyed else ""
        body = json.dumps({"messages": [{"role": "user", "content": "Hello!"}]})
        export = "  (export TANDEM_API_KEY=<the --api-key value> in that shell first)\n" \
            if keyed and not os.environ.get("TANDEM_API_KEY") else ""
        return (
            f"tandem serve: {name} on {url} (speculation: {speculation}"
            f"{f'; warmed up in {warm_s:.1f} s' if warm_s else ''})\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'\n{export}"
            f"  open {url}/ in a browser to chat"
        )

    return lines


def check_listen(host: str, port: int) -> None:
    """ValueError naming the address when the server could not listen there (a port in use,
    an address not on this machine), as uvicorn would find only after the model loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}") from None


def make_server(config: Any, state: Any, drain_timeout: float, banner: Any = None) -> Any:
    """uvicorn.Server with tandem's shutdown: drain, then cancel; exit 0, no re-raised signal."""
    import uvicorn

    class TandemServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if banner is not None and self.servers and not self.should_exit:
                print(banner(self.servers[0].sockets[0].getsockname()[1]), flush=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                self.force_exit = self.force_exit or sig == signal.SIGINT
                return
            print(
                f"tandem serve: stopping (running rows get {drain_timeout:g} s to finish)",
                file=sys.stderr,
                flush=True,
            )
            state.begin_drain(drain_timeout)
            self.should_exit = True

    return TandemServer(config)
