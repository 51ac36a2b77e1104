"""Plain decode: mlx-tandem vs mlx-lm on the same loaded model, same process, same prompt.

For each model/dtype: prefill tok/s and decode tok/s of `mlx_lm.generate.generate_step`
and of tandem's `decode_steps` (the engine under `tandem generate`: the compiled one-token
step where its family is covered, engine/compiled_step.py) and of `decode_steps(compiled=False)`
(the eager step), greedy, N tokens, alternating runs in one process, median of --repeats.
Prints a Markdown table with tandem/mlx-lm ratios, the load average, and whether the tokens
and every step's logprobs were identical to mlx-lm's. `floor ms` is the step's matmuls alone
(every product tandem's compiled step makes — a layer's stacked q/k/v and gate/up as one,
models/fused.py, every other 2-D weight on its own — times a one-token vector, chained as
in a step, nothing else): no step that keeps these BLAS calls can beat it, so mlx-lm's
step / floor bounds the ratio any exact plain path can reach on this machine.

    .venv/bin/python bench/plain_decode.py --tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mlx_tandem  # preloads OpenBLAS before mlx initialises

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten
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


def timed(steps, n: int) -> tuple[float, float, list[int], mx.array]:
    """(prefill seconds = time to first token, decode tok/s over the remaining tokens, tokens,
    the stacked logprobs)."""
    start = time.perf_counter()
    tokens: list[int] = []
    logprobs: list[mx.array] = []
    first = start
    for i, (token, lp) in enumerate(steps):
        tokens.append(int(token))
        logprobs.append(lp.reshape(-1))
        if i == 0:
            first = time.perf_counter()
        if len(tokens) == n:
            break
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first), tokens, mx.stack(logprobs)


def matmul_floor_ms(model, fused=None, repeats: int = 9) -> float:
    """Median ms of one chain of one-token products: each stack of `fused` (a graph's
    stacked projections) and every other 2-D weight of the model."""
    stacks = [s for f in fused or () for s in (f.qkv, f.gate_up) if s is not None]
    views = {id(v) for s in stacks for v in s.views}  # weights the stacks' products cover
    weights = [w for _, w in tree_flatten(model.parameters())
               if w.ndim == 2 and id(w) not in views] + [s.weight for s in stacks]
    if any(w.dtype not in (mx.float32, mx.float16, mx.bfloat16) for w in weights):
        return float("nan")  # quantized: products are not plain matmuls
    xs = {w.shape[1]: mx.random.normal((1, 1, w.shape[1])).astype(w.dtype) for w in weights}
    mx.eval(list(xs.values()))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        carry = mx.zeros((1, 1, 1), dtype=weights[0].dtype)
        outs = []
        for w in weights:  # each product waits for the previous one, as in a step
            out = (xs[w.shape[1]] + carry) @ w.T
            carry = out[..., :1] * 0
            outs.append(out)
        mx.eval(outs)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench(name: str, dtype: str, n: int, repeats: int) -> dict:
    model = load(name, dtype=dtype, progress=False)
    prompt = model.encode(PROMPT)
    results: dict[str, list[tuple[float, float]]] = {"mlx-lm": [], "tandem": [], "eager": []}
    same = True
    keys = list(results)
    for r in range(repeats + 1):  # first round warms up
        outputs: dict[str, tuple[list[int], mx.array]] = {}
        for key in keys[r % 3 :] + keys[: r % 3]:  # alternating, order rotated each round
            if key == "mlx-lm":
                steps = generate_step(mx.array(prompt), model.model, max_tokens=n)
            else:
                sampler = RowSampler(SamplingParams(max_tokens=n), model.graph.vocab_size)
                steps = decode_steps(model.graph, prompt, sampler, n, compiled=key == "tandem")
            p, d, tokens, logprobs = timed(steps, n)
            outputs[key] = (tokens, logprobs)
            results[key].append((len(prompt) / p, d))
        ref_tokens, ref_logprobs = outputs["mlx-lm"]
        for key in ("tandem", "eager"):
            tokens, logprobs = outputs[key]
            same &= tokens == ref_tokens and mx.array_equal(logprobs, ref_logprobs).item()
    med = {k: tuple(statistics.median(x[i] for x in v[1:]) for i in range(2))
           for k, v in results.items()}
    floor = matmul_floor_ms(model.model, model.graph.fused)
    return {"model": name, "dtype": dtype, "prompt": len(prompt), "identical": same,
            "floor": floor, **med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", action="append", help="name:dtype (default: all three cases)")
    args = ap.parse_args()
    cases = [tuple(c.split(":")) for c in args.case] if args.case else CASES
    print(f"# plain decode, {args.tokens} greedy tokens, {platform.machine()}, "
          f"{mx.default_device()}, BLAS {mlx_tandem.BLAS.name}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| model | dtype | prompt | mlx-lm prefill tok/s | tandem prefill tok/s | ratio "
          "| mlx-lm decode tok/s | tandem decode tok/s | ratio | eager decode tok/s | ratio "
          "| identical | floor ms | best exact ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, dtype in cases:
        r = bench(name, dtype, args.tokens, args.repeats)
        (lp, ld), (tp, td), (_, ed) = r["mlx-lm"], r["tandem"], r["eager"]
        print(f"| {name} | {dtype} | {r['prompt']} | {lp:.1f} | {tp:.1f} | {tp / lp:.2f}x "
              f"| {ld:.1f} | {td:.1f} | {td / ld:.2f}x | {ed:.1f} | {ed / ld:.2f}x "
              f"| {r['identical']} | {r['floor']:.1f} | {1000 / ld / r['floor']:.2f}x |",
              flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
