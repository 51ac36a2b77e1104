"""`tandem generate`: mlx_lm.generate's flags, plus --json, --dtype and batching.

One prompt runs on the plain path (token-for-token mlx-lm's `generate_step`);
several (`--prompt` repeated, or `--prompts-file`) run together as one batch
on the rows engine, and `--json` prints one JSON object per prompt.

Oracle: tests/test_cli.py (JSON output; a batch's lines equal each prompt alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mlx_tandem.cli.options import (
    add_draft_flags,
    add_engine_flags,
    add_model_flags,
    add_sampling_flags,
    draft_spec,
    runtime_config,
    sampling_params,
    str2bool,
    template_kwargs,
)

DEFAULT_PROMPT = "hello"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    add_model_flags(p)
    p.add_argument(
        "--prompt",
        "-p",
        action="append",
        default=None,
        help="prompt text ('-' reads stdin); repeat for a batch",
    )
    p.add_argument("--prompts-file", default=None, help="one prompt per line, run as a batch")
    p.add_argument("--system-prompt", default=None, help="a system message before each prompt")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="tokenize the prompt as it is, without the model's chat template")
    p.add_argument("--chat-template-config", default=None, help="JSON kwargs for the template")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt tokens per prefill step of the plain path (mlx-lm's; default "
                   "%(default)s; the rows engine's is --prefill-chunk)")
    add_sampling_flags(p)
    add_engine_flags(p)
    add_draft_flags(p)
    p.add_argument(
        "--engine",
        choices=("auto", "plain", "rows"),
        default="auto",
        help="plain: mlx-lm's arithmetic, one prompt; rows: the batched engine, whose "
        "output for a prompt is the same alone, in any batch and speculated (auto: plain for "
        "one prompt without a drafter, else rows; the two differ by rounding, so rarely a "
        "token: docs/ARCHITECTURE.md)",
    )
    p.add_argument(
        "--verbose",
        type=str2bool,
        default=True,
        help="'False' prints only the text (as mlx_lm.generate)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(run=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:  # never fall back to the default prompt for a file that has none
            raise ValueError(f"--prompts-file {args.prompts_file}: no prompts (every line is blank)")
        prompts += lines
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    if prompts.count("-") > 1:
        raise ValueError("--prompt - reads stdin once: give it as one prompt only")
    out = []
    for text in prompts:
        text = text.replace("\\n", "\n").replace("\\t", "\t")
        out.append(sys.stdin.read() if text == "-" else text)
    return out


def run(args: argparse.Namespace) -> int:
    from mlx_tandem.models.loader import load

    if args.prefill_step_size < 1:
        raise ValueError("--prefill-step-size must be >= 1")
    args.draft_model = draft_spec(args.draft_model)  # 'none': no drafter, from here on
    kwargs = template_kwargs(args.chat_template_config)
    texts = read_prompts(args)
    if args.engine == "plain" and len(texts) > 1:
        raise ValueError("--engine plain runs one prompt; use --engine rows for a batch")
    if args.engine == "plain" and args.draft_model:
        raise ValueError("--draft-model needs the rows engine (drop --engine plain)")
    if args.engine == "plain" and args.grammar is not None:
        raise ValueError("--json-schema needs the rows engine (drop --engine plain)")
    if args.logprobs and not args.json:
        raise ValueError("--logprobs are reported in --json output: add --json")
    config = runtime_config(args)  # validates --kv-codec / --kv-bits before loading
    if args.engine == "plain" and config.kv_codec != "fp":
        raise ValueError("--kv-codec/--kv-bits need the rows engine (drop --engine plain)")
    rows_flags = [flag for flag, value in (("--max-rows", args.max_rows),
                                           ("--prefill-chunk", args.prefill_chunk),
                                           ("--memory-budget", args.memory_budget))
                  if value is not None]  # fmt: skip
    if args.engine == "plain" and rows_flags:
        raise ValueError(f"{', '.join(rows_flags)}: rows engine options (drop --engine plain)")
    use_rows = (
        args.engine == "rows" or len(texts) > 1 or bool(args.draft_model) or bool(args.grammar)
        or config.kv_codec != "fp" or bool(rows_flags)
    )
    model = load(args.model, dtype=args.dtype, progress=not args.json)
    params = sampling_params(args, model.tokenizer)
    prompts = [
        model.encode(
            t,
            chat=not args.ignore_chat_template,
            system_prompt=args.system_prompt,
            template_kwargs=kwargs,
        )
        for t in texts
    ]
    if not use_rows:
        return run_plain(args, model, prompts[0], params)
    return run_batch(args, model, prompts, params, config)


def _json_result(
    model,
    text: str,
    tokens: list[int],
    prompt: list[int],
    finish: str,
    timing: dict[str, float],
    logprobs: list | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model.name,
        "text": text,
        "tokens": tokens,
        "prompt_tokens": prompt,
        "finish_reason": finish,
        "timing": timing,
    }
    if logprobs:
        out["logprobs"] = [
            {"token": i.token, "logprob": i.logprob, "top": [list(t) for t in i.top]}
            for i in logprobs
        ]
    return out


def spec_stats(stats) -> dict:
    return {
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance": stats.accepted / stats.drafted if stats.drafted else 0.0,
        "mean_accepted_length": stats.mean_accepted_length,
    }


def run_plain(args, model, prompt: list[int], params) -> int:
    from mlx_tandem.engine.generate import generate, stream_generate

    if args.json:
        r = generate(model, prompt, params, prefill_step_size=args.prefill_step_size)
        s = r.stats
        timing = {
            "ttft_s": s.ttft_s,
            "prompt_tps": s.prompt_tps,
            "generation_tps": s.generation_tps,
            "peak_memory_gb": s.peak_memory_gb,
        }
        body = _json_result(
            model, r.text, r.tokens, r.prompt_tokens, r.finish_reason, timing, r.logprobs
        )
        print(json.dumps({"index": 0, **body}))  # the keys of the rows engine's objects
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


def run_batch(args, model, prompts: list[list[int]], params, config) -> int:
    import time

    from mlx_tandem.drafters.factory import build_depth, build_drafter
    from mlx_tandem.engine.service import Engine

    drafter = depth = None
    if args.draft_model:
        depth = build_depth(args.draft_depth, args.num_draft_tokens)
        drafter = build_drafter(args.draft_model, model, config, dtype=args.dtype)
    engine = Engine(model, config, drafter=drafter, depth=depth)
    try:
        start = time.perf_counter()
        handles = [engine.submit(p, params) for p in prompts]
        results = [h.result() for h in handles]
        elapsed = time.perf_counter() - start
    finally:
        engine.shutdown()
    total = 0
    for i, (res, prompt) in enumerate(zip(results, prompts, strict=True)):
        total += len(res.tokens)
        if res.finish_reason == "error":
            raise RuntimeError(f"prompt {i}: {res.error}")
        spec = spec_stats(res.stats) if drafter else None
        if args.json:
            timing = {"ttft_s": res.stats.ttft_s, "generation_tps": res.stats.generation_tps}
            body = _json_result(
                model, res.text, res.tokens, prompt, res.finish_reason, timing, res.logprobs
            )
            print(json.dumps({"index": i, **body, **({"speculative": spec} if spec else {})}))
        else:
            if args.verbose:  # --verbose False: only the text, as for one prompt
                print(f"========== [{i}] {res.finish_reason}, {len(res.tokens)} tokens")
            print(res.text)
            if args.verbose and spec:
                print(
                    f"drafted {spec['drafted']}, accepted {spec['accepted']} "
                    f"({spec['acceptance']:.2f}), mean accepted length "
                    f"{spec['mean_accepted_length']:.2f}"
                )
    if args.verbose and not args.json:
        print("=" * 10)
        print(
            f"Rows engine: {len(prompts)} prompt{'s' * (len(prompts) != 1)}, {total} tokens in "
            f"{elapsed:.2f} s "
            f"({total / elapsed:.1f} tokens-per-sec)"
        )
        for name in engine.stats.drafted:  # the drafter's, and grammar-forced proposals
            print(
                f"Speculative ({name}): acceptance {engine.stats.acceptance(name):.2f} over "
                f"{engine.stats.drafted[name]} drafted tokens"
            )
    return 0
