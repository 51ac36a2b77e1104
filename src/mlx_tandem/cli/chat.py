"""`tandem chat`: an interactive multi-turn chat on stdin/stdout (like mlx_lm.chat).

Oracle: tests/test_cli.py (the CLI's shared flags and one-line errors).
"""

from __future__ import annotations

import argparse
import sys

from mlx_tandem.cli.options import add_model_flags, add_sampling_flags, sampling_params


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat (/reset clears, /exit or EOF quits)")
    add_model_flags(p)
    p.add_argument("--system-prompt", default=None)
    add_sampling_flags(p, max_tokens=512)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mlx_tandem.engine.generate import stream_generate
    from mlx_tandem.models.loader import load

    model = load(args.model, dtype=args.dtype)
    params = sampling_params(args, model.tokenizer)
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
            for chunk in stream_generate(model, prompt, params):
                print(chunk.text, end="", flush=True)
                reply += chunk.text
        except ValueError as err:  # e.g. the conversation outgrew the context window
            messages.pop()
            print(f"\nerror: {err} (use /reset)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
