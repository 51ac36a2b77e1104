"""`tandem chat`: an interactive multi-turn chat on stdin/stdout (like mlx_lm.chat, and with
its defaults: 256 tokens a turn, seed 0, so a session with the same turns replies the same).

Turns run on the plain path (mlx-lm's arithmetic); with --json-schema they run on the
rows engine, the decoding path that takes a grammar (as `tandem generate` does).

Oracle: tests/test_cli.py (the CLI's shared flags and one-line errors, constrained turns).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from mlx_tandem.cli.options import add_model_flags, add_sampling_flags, sampling_params


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat (/reset clears, /exit or EOF quits)")
    add_model_flags(p)
    p.add_argument("--system-prompt", default=None, help="a system message opening the chat")
    add_sampling_flags(p, max_tokens=256, seed=0)  # mlx_lm.chat's: a session is reproducible
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mlx_tandem.models.loader import load

    model = load(args.model, dtype=args.dtype)
    params = sampling_params(args, model.tokenizer)
    engine = None
    if params.grammar is not None:
        from mlx_tandem.engine.config import RuntimeConfig
        from mlx_tandem.engine.service import Engine

        engine = Engine(model, RuntimeConfig.resolve())
    try:
        if engine is not None:
            engine.grammars.compile(params.grammar)  # a bad schema fails now, not every turn
        return _loop(args, model, params, engine)
    finally:
        if engine is not None:
            engine.shutdown()


def _reply(model, engine, prompt: list[int], params) -> Iterator[str]:
    """The reply's text pieces: the plain path, or the engine for a constrained turn."""
    if engine is None:
        from mlx_tandem.engine.generate import stream_generate

        for chunk in stream_generate(model, prompt, params):
            yield chunk.text
        return
    handle = engine.submit(prompt, params)  # ValueError before anything is queued
    try:
        for out in handle:
            yield out.text
            if out.finish_reason == "error":
                raise ValueError(f"the engine failed this turn: {out.error}")
    finally:
        handle.cancel()  # no-op once finished; ends the request if the turn is abandoned


def _loop(args: argparse.Namespace, model, params, engine: Any) -> int:
    if not model.tokenizer.has_chat_template:
        print(
            f"note: {model.name} has no chat template; turns are joined as plain text",
            file=sys.stderr,
        )
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    print(f"[{model.name}] /reset clears the conversation, /exit quits", file=sys.stderr)
    while True:
        if interactive:
            print(">> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = model.encode_messages(messages)
        reply = ""
        try:
            for text in _reply(model, engine, prompt, params):
                print(text, end="", flush=True)
                reply += text
        except ValueError as err:  # e.g. the conversation outgrew the context window
            messages.pop()
            print(f"\nerror: {err} (use /reset)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
