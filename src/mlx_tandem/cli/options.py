"""Flags shared by subcommands (model, dtype, sampling), spelled as mlx_lm.generate spells them."""

from __future__ import annotations

import argparse
import json

from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.models.catalogue import DEFAULT_MODEL
from mlx_tandem.models.loader import DTYPES


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"mlx-lm folder, .gguf file or catalogue name (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights: auto (float32 on CPU, native on GPU), native (keep GGUF "
        "quantization), float32, q8, q4 (re-quantize)",
    )


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int = 100) -> None:
    p.add_argument("--max-tokens", "-m", type=int, default=max_tokens)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens-to-keep", type=int, default=1)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--repetition-context-size", type=int, default=20)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument(
        "--logit-bias",
        type=json.loads,
        default=None,
        help="JSON object of token id -> bias, e.g. '{\"42\": -100}'",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--extra-eos-token",
        action="append",
        default=[],
        help="extra end-of-sequence token (string, repeatable)",
    )
    p.add_argument("--logprobs", type=int, default=0, help="top-N logprobs per token (with --json)")


def sampling_params(args: argparse.Namespace, tokenizer) -> SamplingParams:
    bias = args.logit_bias or {}
    if not isinstance(bias, dict):
        raise ValueError("--logit-bias must be a JSON object of token id -> bias")
    try:
        logit_bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"--logit-bias has a non-numeric entry: {err}") from None
    extra_ids = []
    for token in args.extra_eos_token:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"--extra-eos-token {token!r} is not a single token ({len(ids)} ids)")
        extra_ids.append(ids[0])
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        min_tokens_to_keep=args.min_tokens_to_keep,
        repetition_penalty=args.repetition_penalty,
        repetition_context_size=args.repetition_context_size,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=logit_bias,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(extra_ids),
        logprobs=args.logprobs,
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-rows", type=int, default=None, help="rows decoded together (16)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens per prefill chunk (default: auto)",
    )
    p.add_argument("--memory-budget", default=None, help="KV-cache budget, e.g. 4G (default: auto)")
    p.add_argument(
        "--batch-invariant",
        type=str2bool,
        default=None,
        help="exact batch invariance (default True; False is faster at small batch)",
    )


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding: a draft model (folder, .gguf, catalogue name) "
        "sharing the target's tokenizer, or 'ngram' for prompt lookup",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        help="tokens drafted per step (the maximum with --draft-depth adaptive)",
    )
    p.add_argument("--draft-depth", choices=("fixed", "adaptive"), default="fixed")


def runtime_config(args: argparse.Namespace):
    from mlx_tandem.engine.config import RuntimeConfig, parse_bytes

    return RuntimeConfig.resolve(
        max_rows=args.max_rows,
        prefill_chunk=args.prefill_chunk,
        memory_budget=parse_bytes(args.memory_budget) if args.memory_budget else None,
        batch_invariant=args.batch_invariant,
    )


def str2bool(value: str) -> bool:
    """mlx_lm.generate's convention: anything but 'false'/'f' is true."""
    return value.lower() not in ("false", "f")


def template_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--chat-template-config is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-config must be a JSON object")
    return value
