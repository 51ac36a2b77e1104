"""Plain decode: mlx-tandem vs mlx-lm on the same loaded model, same process, same prompt.

For each model/dtype: prefill tok/s and decode tok/s of `mlx_lm.generate.generate_step`
and of tandem's `decode_steps` (the engine under `tandem generate`), greedy, N tokens,
alternating runs, median of --repeats. Prints a Markdown table with tandem/mlx-lm ratios.

    .venv/bin/python bench/plain_decode.py --tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx_tandem  # preloads OpenBLAS before mlx initialises

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_tandem import SamplingParams
from mlx_tandem.engine.generate import decode_steps
from mlx_tandem.engine.sampling import RowSampler
from mlx_tandem.models.loader import load

PROMPT = (
    "Write a short story about a lighthouse keeper who discovers that the light has been "
    "guiding ships that no longer exist. Describe the keeper, the island, and the night "
    "everything changed, in plain, vivid language."
)
CASES = (("smollm2-135m", "native"), ("smollm2-135m", "float32"), ("gemma3-270m", "float32"))


def timed(steps, n: int) -> tuple[float, float, list[int]]:
    """(prefill seconds = time to first token, decode tok/s over the remaining tokens, tokens)."""
    start = time.perf_counter()
    tokens: list[int] = []
    first = start
    for i, (token, _) in enumerate(steps):
        tokens.append(int(token))
        if i == 0:
            first = time.perf_counter()
        if len(tokens) == n:
            break
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first), tokens


def bench(name: str, dtype: str, n: int, repeats: int) -> dict:
    model = load(name, dtype=dtype, progress=False)
    prompt = model.encode(PROMPT)
    results: dict[str, list[tuple[float, float]]] = {"mlx-lm": [], "tandem": []}
    same = True
    for _ in range(repeats + 1):  # first round warms up
        p1, d1, t1 = timed(generate_step(mx.array(prompt), model.model, max_tokens=n), n)
        sampler = RowSampler(SamplingParams(max_tokens=n), model.graph.vocab_size)
        p2, d2, t2 = timed(decode_steps(model.graph, prompt, sampler, n), n)
        same &= t1 == t2
        results["mlx-lm"].append((len(prompt) / p1, d1))
        results["tandem"].append((len(prompt) / p2, d2))
    med = {k: tuple(statistics.median(x[i] for x in v[1:]) for i in range(2))
           for k, v in results.items()}
    return {"model": name, "dtype": dtype, "prompt": len(prompt), "same_tokens": same, **med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", action="append", help="name:dtype (default: all three cases)")
    args = ap.parse_args()
    cases = [tuple(c.split(":")) for c in args.case] if args.case else CASES
    print(f"# plain decode, {args.tokens} greedy tokens, {platform.machine()}, "
          f"{mx.default_device()}, BLAS {mlx_tandem.BLAS.name}, {time.strftime('%Y-%m-%d')}")
    print("| model | dtype | prompt | mlx-lm prefill tok/s | tandem prefill tok/s | ratio "
          "| mlx-lm decode tok/s | tandem decode tok/s | ratio | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, dtype in cases:
        r = bench(name, dtype, args.tokens, args.repeats)
        (lp, ld), (tp, td) = r["mlx-lm"], r["tandem"]
        print(f"| {name} | {dtype} | {r['prompt']} | {lp:.1f} | {tp:.1f} | {tp / lp:.2f}x "
              f"| {ld:.1f} | {td:.1f} | {td / ld:.2f}x | {r['same_tokens']} |", flush=True)


if __name__ == "__main__":
    main()
