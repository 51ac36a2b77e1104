"""Perplexity of a converted model on a fixed English paragraph: a quick whole-model sanity check.

Owns: the end-to-end numeric check of a GGUF conversion that greedy tokens cannot give. A plausible
but wrong config (e.g. Gemma 3's local rope base or query scale) still produces fluent text; it shows
up here as a higher perplexity. On this 118-token paragraph Gemma 3 270M float32 gives 7.68 and a
wrong local rope base (1e6) 11.17; GGUF_NOTES.md's reference paragraph (not this one) gave 7.26 / 9.20.

Usage:
    python bench/perplexity.py --model-dir /tmp/tandem-convert/gemma3-float32
    python bench/perplexity.py --gguf /tmp/models/gemma-3-270m-q4_k_m.gguf --dtype float32
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

# isort: split
import mlx.core as mx
import mlx.nn as nn

TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. Heat "
    "from the Sun causes water to evaporate from the surface of seas, lakes and rivers. The water "
    "vapour rises into the atmosphere, where it cools and condenses into tiny droplets that form "
    "clouds. When the droplets grow large enough, they fall back to the ground as rain or snow. "
    "Some of this water flows over the land into rivers and returns to the sea, while some soaks "
    "into the soil and becomes groundwater. Plants also release water into the air through their "
    "leaves, a process known as transpiration."
)


def perplexity_of(model: nn.Module, tokenizer: Any, text: str = TEXT) -> tuple[float, int]:
    """(perplexity, number of predicted tokens) of `text` under a loaded mlx-lm model."""
    ids = tokenizer.encode(text)  # adds bos when the tokenizer says so (Gemma)
    tokens = mx.array([ids])
    logits = model(tokens[:, :-1]).astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")
    return math.exp(nll.item()), len(ids) - 1


def perplexity(model_dir: str | Path, text: str = TEXT) -> tuple[float, int]:
    """(perplexity, number of predicted tokens) of `text` under the model in model_dir."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))
    return perplexity_of(model, tokenizer, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="an mlx-lm model folder (e.g. from convert_gguf)")
    src.add_argument("--gguf", help="a GGUF file, converted first into --out")
    parser.add_argument("--dtype", default="native", help="conversion dtype with --gguf")
    parser.add_argument(
        "--out",
        default=None,
        help="conversion folder with --gguf (default /tmp/tandem-convert/ppl-NAME-DTYPE)",
    )
    args = parser.parse_args(argv)
    model_dir = args.model_dir
    if args.gguf:
        from mlx_tandem.models.gguf_import import convert_gguf

        out = args.out or f"/tmp/tandem-convert/ppl-{Path(args.gguf).stem}-{args.dtype}"
        start = time.perf_counter()
        model_dir = convert_gguf(args.gguf, out, dtype=args.dtype)
        print(f"converted to {model_dir} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    start = time.perf_counter()
    ppl, n = perplexity(model_dir)
    print(
        f"perplexity {ppl:.3f} over {n} tokens ({time.perf_counter() - start:.1f} s) [{model_dir}]"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
