"""Flags shared by subcommands (model, dtype, sampling, engine), spelled as mlx_lm spells them.

The sampling flags are derived from SamplingParams' knobs (engine/sampling.py), never
listed here. Oracle: tests/test_cli.py (flag names and errors), tests/test_serve_cli.py
(`tandem serve`'s flags equal mlx_lm.server's).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_tandem.engine.config import BOOLEAN_WORDS, parse_bool, parse_bytes, parse_cache_bytes
from mlx_tandem.engine.sampling import (
    Grammar,
    InvalidParameter,
    SamplingParams,
    bias_from_json,
    knobs,
)
from mlx_tandem.kv.codec import NAMES_HELP
from mlx_tandem.models.catalogue import DEFAULT_MODEL
from mlx_tandem.models.loader import DTYPES


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"mlx-lm folder (MLX-quantized too), .gguf file, catalogue name or Hugging Face "
        f"repo id, e.g. mlx-community/Qwen3-0.6B-4bit (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights: auto (float32 on CPU, native on GPU), native (keep GGUF "
        "quantization), float32, q8, q4 (re-quantize)",
    )


def add_sampling_flags(
    p: argparse.ArgumentParser, max_tokens: int = 100, *, server: bool = False,
    seed: int | None = None,
) -> None:
    """One flag per SamplingParams knob that has a CLI spelling (mlx_lm.generate's names);
    `max_tokens` and `seed`: the command's defaults (mlx_lm.chat's differ from generate's).

    server=True: only the knobs `tandem serve` takes as server-wide defaults.
    """
    base = SamplingParams(max_tokens=max_tokens, seed=seed)
    for name, (k, _) in knobs().items():
        if not k.flags or (server and not k.server):
            continue
        default = getattr(base, name)
        help_ = f"{'default ' if server else ''}{k.help}"
        if k.kind == "strings":
            p.add_argument(*k.flags, dest=name, action="append", default=list(default), help=help_)
        elif k.kind == "bias":
            # parsed in sampling_values: a bad value is a one-line error, not argparse's usage
            p.add_argument(*k.flags, dest=name, default=None, help=help_)
        elif k.kind == "grammar":
            p.add_argument(*k.flags, dest=name, type=_json_schema, default=None, help=help_)
        else:
            kind = int if k.kind == "int" else float
            p.add_argument(*k.flags, dest=name, type=kind, default=default, help=help_)
    if not server:
        p.add_argument(
            "--extra-eos-token",
            action="append",
            default=[],
            help="extra end-of-sequence token (string, repeatable)",
        )


def sampling_values(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed sampling flags as SamplingParams keyword arguments (which reads a knob's
    `off` value as off)."""
    values: dict[str, Any] = {}
    for name, (k, _) in knobs().items():
        if not k.flags or not hasattr(args, name):
            continue
        value = getattr(args, name)
        if k.kind == "bias":
            value = _logit_bias(value)
        elif k.kind == "strings":
            value = tuple(value)
        values[name] = value
    return values


def _json_schema(text: str) -> Grammar:
    """--json-schema: a JSON schema given inline or as a file path ('object': any object)."""
    if text == "object":
        return Grammar("json_object")
    path = Path(text)
    if not text.lstrip().startswith(("{", "[")) and path.is_file():
        text = path.read_text(encoding="utf-8")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not a JSON schema or a schema file: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise argparse.ArgumentTypeError("a JSON schema is an object or a boolean")
    return Grammar("json_schema", json.dumps(schema))


def _logit_bias(text: str | None) -> dict[int, float]:
    """--logit-bias: a JSON object mapping token ids to biases, e.g. '{"42": -100}'."""
    if text is None:
        return {}
    try:
        bias = json.loads(text)
    except json.JSONDecodeError:
        bias = None
    if not isinstance(bias, dict):
        raise ValueError(
            f"--logit-bias must be a JSON object mapping token ids to biases "
            f"(e.g. '{{\"42\": -100}}'), got {text!r}"
        )
    try:
        return bias_from_json(bias)
    except InvalidParameter as err:
        raise ValueError(f"--logit-bias: {err}") from None


def sampling_params(args: argparse.Namespace, tokenizer: Any) -> SamplingParams:
    extra_ids = []
    for token in args.extra_eos_token:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"--extra-eos-token {token!r} is not a single token ({len(ids)} ids)")
        extra_ids.append(ids[0])
    return SamplingParams(**sampling_values(args), stop_token_ids=tuple(extra_ids))


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-rows", type=int, default=None, help="rows decoded together (16)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens per prefill chunk (default: auto)",
    )
    p.add_argument(
        "--prefill-taper",
        type=int,
        default=None,
        help="prompt depth at which a chunk is half its size (0: every chunk the same; "
        "default: auto, where a token's attention costs as much as its projections)",
    )
    p.add_argument("--memory-budget", default=None, help="KV-cache budget, e.g. 4G (default: auto)")
    p.add_argument(
        "--buffer-cache",
        default=None,
        help="freed memory MLX keeps for reuse, e.g. 512M, or 0 (default: auto; on a CPU "
        "min(1G, a 16th of memory): MLX's 32M makes a step fault in fresh pages)",
    )
    p.add_argument(
        "--batch-invariant",
        type=str2bool,
        default=None,
        help="exact batch invariance (default True; False is faster at small batch)",
    )
    p.add_argument(
        "--kv-codec",
        default=None,
        help=f"how rows store K/V (default fp): {NAMES_HELP} (docs/ARCHITECTURE.md: KV codecs)",
    )
    p.add_argument("--kv-bits", type=int, default=None, help="mlx-lm spelling: --kv-codec affine<B>")
    p.add_argument("--kv-group-size", type=int, default=None, help="with --kv-bits (default 64)")


def draft_spec(text: str | None) -> str | None:
    """--draft-model as parsed: 'none' (any case) means no drafter, as `tandem serve` spells
    it (serve reads the raw text itself, so this is applied by the caller, not by argparse)."""
    return None if text is None or text.strip().lower() == "none" else text


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding ('none': off): a draft model (folder, .gguf, catalogue name) "
        "sharing the target's tokenizer, 'ngram' for prompt lookup, 'mtp' for the target "
        "checkpoint's own MTP layer (Qwen3-Next / Qwen3.5), or 'assistant' "
        "(the target's assistant drafter, shipped or from `tandem distill`; "
        "'assistant:sample' drafts sampled rows stochastically), or an assistant folder; "
        "'SPEC+ngram' (e.g. 'assistant+ngram') drafts by prompt lookup where a row's text "
        "recurs and by SPEC elsewhere",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        help="tokens drafted per step (the maximum with --draft-depth adaptive)",
    )
    p.add_argument("--draft-depth", choices=("fixed", "adaptive"), default="fixed",
                   help="fixed: every row drafts --num-draft-tokens; adaptive: as deep as each "
                   "row's measured acceptance pays for, off where it does not "
                   "(default %(default)s)")


def runtime_config(args: argparse.Namespace):
    from mlx_tandem.engine.config import RuntimeConfig
    from mlx_tandem.kv.codec import codec_from_flags

    kv_codec = codec_from_flags(
        getattr(args, "kv_codec", None), getattr(args, "kv_bits", None),
        getattr(args, "kv_group_size", None),
    )
    return RuntimeConfig.resolve(
        max_rows=args.max_rows,
        prefill_chunk=args.prefill_chunk,
        prefill_taper=getattr(args, "prefill_taper", None),
        memory_budget=memory_budget(args.memory_budget),
        buffer_cache=buffer_cache(getattr(args, "buffer_cache", None)),
        batch_invariant=args.batch_invariant,
        kv_codec=kv_codec,
    )


def memory_budget(text: str | None) -> int | None:
    """--memory-budget in bytes (None: auto); ValueError naming the flag for a bad size."""
    return _flag_bytes("--memory-budget", text, parse_bytes)


def buffer_cache(text: str | None) -> int | None:
    """--buffer-cache in bytes, 0 or auto (None); ValueError naming the flag for a bad size."""
    return _flag_bytes("--buffer-cache", text, parse_cache_bytes)


def _flag_bytes(flag: str, text: str | None, parse: Callable[[str], int | None]) -> int | None:
    if not text:
        return None
    try:
        return parse(text)
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None


def str2bool(value: str) -> bool:
    """A boolean flag, spelled as engine/config.parse_bool reads it; anything else is an error."""
    parsed = parse_bool(value)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"expected {BOOLEAN_WORDS}, got {value!r}")
    return parsed


# what the CLI passes apply_chat_template (or the template) itself: a second value is a TypeError
RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "conversation", "messages", "tokenize")


def template_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--chat-template-config is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-config must be a JSON object")
    reserved = [k for k in RESERVED_TEMPLATE_KWARGS if k in value]
    if reserved:
        raise ValueError(
            f"--chat-template-config may not set {', '.join(map(repr, reserved))}: "
            "the CLI passes these itself"
        )
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value
