"""`tandem generate`: mlx_lm.generate's flags, plus --json and --dtype."""

from __future__ import annotations

import argparse
import json
import sys

from mlx_tandem.cli.options import (
    add_model_flags,
    add_sampling_flags,
    sampling_params,
    str2bool,
    template_kwargs,
)

DEFAULT_PROMPT = "hello"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for a prompt")
    add_model_flags(p)
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="prompt text ('-' reads stdin)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument("--chat-template-config", default=None, help="JSON kwargs for the template")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    add_sampling_flags(p)
    p.add_argument(
        "--verbose",
        type=str2bool,
        default=True,
        help="'False' prints only the text (as mlx_lm.generate)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object with text, ids, timing"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mlx_tandem.engine.generate import generate, stream_generate
    from mlx_tandem.models.loader import load

    if args.prefill_step_size < 1:
        raise ValueError("--prefill-step-size must be >= 1")
    kwargs = template_kwargs(args.chat_template_config)
    model = load(args.model, dtype=args.dtype, progress=not args.json)
    params = sampling_params(args, model.tokenizer)
    text = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    text = sys.stdin.read() if text == "-" else text
    prompt = model.encode(
        text,
        chat=not args.ignore_chat_template,
        system_prompt=args.system_prompt,
        template_kwargs=kwargs,
    )
    if args.json:
        result = generate(model, prompt, params, prefill_step_size=args.prefill_step_size)
        s = result.stats
        out = {
            "model": model.name,
            "text": result.text,
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "finish_reason": result.finish_reason,
            "timing": {
                "ttft_s": s.ttft_s,
                "prompt_tps": s.prompt_tps,
                "generation_tps": s.generation_tps,
                "peak_memory_gb": s.peak_memory_gb,
            },
        }
        if params.logprobs:
            out["logprobs"] = [
                {"token": i.token, "logprob": i.logprob, "top": [list(t) for t in i.top]}
                for i in result.logprobs
            ]
        print(json.dumps(out))
        return 0
    if args.verbose:
        print("=" * 10)
    stats, produced = None, ""
    for chunk in stream_generate(model, prompt, params, prefill_step_size=args.prefill_step_size):
        print(chunk.text, end="", flush=True)
        produced += chunk.text
        stats = chunk.stats or stats
    print()
    if args.verbose and stats is not None:
        print("=" * 10)
        if not produced:
            print("No text generated for this prompt")
        print(f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {stats.generation_tokens} tokens, "
            f"{stats.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {stats.peak_memory_gb:.3f} GB")
    return 0
