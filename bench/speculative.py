"""Speculative decoding: mlx-tandem vs mlx-lm and vs tandem without speculation.

Same process, same loaded model, greedy. Cases:
  (a) B=1, the model drafting for itself (acceptance 1.0 isolates the machinery's
      cost): tandem rows engine vs mlx-lm `speculative_generate_step`;
  (b) prompt lookup (ngram) on input-grounded prompts (rewrite / edit a given
      passage) at B=1 and B=8, vs tandem plain and vs mlx-lm `batch_generate`;
  (c) the self-draft pair at B=8 vs tandem batched plain.
Each row reports tok/s, acceptance rate and mean accepted length (tokens per
target forward).

    .venv/bin/python bench/speculative.py --model smollm2-135m --tokens 64 --k 4
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import time

import mlx.core as mx
from common import machine_line, mlx_lm_batch
from mlx_lm.generate import speculative_generate_step

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import AdaptiveDepth, FixedDepth
from mlx_tandem.models.loader import load

PASSAGE = (
    "The old harbour town wakes slowly. Fishing boats return at dawn, their decks crowded with "
    "nets and crates, and the gulls follow them in wide circles. By eight o'clock the market "
    "stalls are open, the bakery has sold its first loaves, and the ferry to the island sounds "
    "its horn twice before leaving the pier."
)
GROUNDED = [
    f"Rewrite the following passage in the past tense, changing nothing else:\n\n{PASSAGE}",
    f"Copy the following passage exactly, but replace 'harbour' with 'harbor':\n\n{PASSAGE}",
    f"Repeat this passage word for word:\n\n{PASSAGE}",
    "Fix the bug in this function and print the whole corrected function:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(value)\n",
    f"Rewrite the passage below, replacing every 'the' with 'a':\n\n{PASSAGE}",
    f"Quote the first two sentences of this passage exactly:\n\n{PASSAGE}",
    "Add type hints to this Python function and show the full result:\n\n"
    "def greet(name, times):\n    for i in range(times):\n        print('hello ' + name)\n"
    "    return len(name) * times\n",
    f"Rewrite this passage in the first person plural ('we'):\n\n{PASSAGE}",
]


def tandem(model, prompts, n, drafter=None, k=4, adaptive=False):
    depth = AdaptiveDepth(k) if adaptive else FixedDepth(k)
    engine = EngineCore(model, RuntimeConfig.resolve(max_rows=16), drafter=drafter, depth=depth)
    start = time.perf_counter()
    handles = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    results = [h.result() for h in handles]
    tokens = sum(len(r.tokens) for r in results)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    steps = sum(r.stats.steps for r in results)
    return {"tps": tokens / seconds, "acc": accepted / drafted if drafted else 0.0,
            "al": tokens / steps if steps else 0.0, "tokens": [r.tokens for r in results]}


def mlx_lm_spec(model, prompt, n, k):
    start = time.perf_counter()
    steps = speculative_generate_step(mx.array(prompt), model.model, model.model,
                                      num_draft_tokens=k, max_tokens=n)
    tokens, from_draft = [], 0
    for token, _, drafted in steps:
        tokens.append(token)
        from_draft += bool(drafted)
    seconds = time.perf_counter() - start
    return {"tps": len(tokens) / seconds, "acc": float("nan"), "al": float("nan"), "tokens": [tokens]}


def mlx_lm_batch_row(model, prompts, n):
    start = time.perf_counter()
    tokens = mlx_lm_batch(model, prompts, n)
    seconds = time.perf_counter() - start
    return {"tps": sum(len(t) for t in tokens) / seconds, "acc": float("nan"),
            "al": float("nan"), "tokens": tokens}


def row(case, r, base):
    print(f"| {case} | {r['tps']:.1f} | {r['tps'] / base['tps']:.2f}x | "
          f"{r['acc']:.2f} | {r['al']:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    model = load(args.model, dtype=args.dtype, progress=False)
    n, k = args.tokens, args.k
    grounded = [model.encode(p) for p in GROUNDED]
    print(machine_line(f"speculative decoding, {args.model} {model.dtype}, {n} tokens/row, k={k}"))
    print("| case | tok/s | vs baseline | acceptance | mean accepted length |")
    print("|---|---|---|---|---|")
    tandem(model, grounded[:1], 4)  # warm-up
    # (a) machinery cost: the model drafts for itself, B=1
    ref = mlx_lm_spec(model, grounded[0], n, k)
    row("(a) mlx-lm speculative_generate_step, self-draft, B=1 [baseline]", ref, ref)
    row("(a) tandem self-draft, B=1", tandem(model, grounded[:1], n, DraftModelSource(model), k), ref)
    # (b) prompt lookup on input-grounded prompts
    for b in (1, 8):
        plain = tandem(model, grounded[:b], n)
        row(f"(b) tandem plain, B={b} [baseline]", plain, plain)
        row(f"(b) mlx-lm batch_generate, B={b}", mlx_lm_batch_row(model, grounded[:b], n), plain)
        row(f"(b) tandem ngram, fixed k, B={b}",
            tandem(model, grounded[:b], n, PromptLookupSource(), k), plain)
        row(f"(b) tandem ngram, adaptive depth, B={b}",
            tandem(model, grounded[:b], n, PromptLookupSource(), k, adaptive=True), plain)
    # (c) the self-draft pair at B=8
    plain = tandem(model, grounded, n)
    row("(c) tandem plain, B=8 [baseline]", plain, plain)
    row("(c) tandem self-draft, B=8", tandem(model, grounded, n, DraftModelSource(model), k), plain)


if __name__ == "__main__":
    main()
