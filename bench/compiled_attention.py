"""Is `mx.compile` worth it for the rows engine's attention? Compiled vs plain vs mlx's fused SDPA.

The rows engine's decode step keeps per-row cache bookkeeping on the host, so the whole
step cannot be one compiled graph; its attention kernel is the pure-array part. This
times it (SmolLM2 head shape: 9 query heads, 3 kv heads, dim 64) and checks the
compiled output is identical.

    .venv/bin/python bench/compiled_attention.py
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split
import time
from functools import partial

import mlx.core as mx
from common import machine_line

from mlx_tandem.kv.attention import invariant_attention, stable_group_rows


def bench(f, n: int = 30) -> float:
    for _ in range(3):
        mx.eval(f())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    rows = stable_group_rows(64, 9, 3, str(mx.float32))
    print(machine_line("compiled attention (9/3 heads, dim 64)"))
    print("| B | keys | plain ms | compiled ms | ratio | fused SDPA ms (not batch-invariant) | identical |")
    print("|---|---|---|---|---|---|---|")
    for B, W in ((1, 256), (8, 512), (16, 1024)):
        case(B, W, rows)


def case(B: int, W: int, rows: int) -> None:
    q = mx.random.normal((B, 9, 1, 64))
    k = mx.random.normal((B, 3, W, 64))
    v = mx.random.normal((B, 3, W, 64))
    valid = (mx.arange(W)[None, None] < W - 100)[:, None] | mx.zeros((B, 1, 1, W), mx.bool_)
    compiled = mx.compile(partial(invariant_attention, scale=0.125, group_rows=rows))
    plain = bench(lambda: invariant_attention(q, k, v, 0.125, valid, rows))
    comp = bench(lambda: compiled(q, k, v, valid=valid))
    fused = bench(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=valid))
    same = mx.array_equal(invariant_attention(q, k, v, 0.125, valid, rows),
                          compiled(q, k, v, valid=valid)).item()
    print(f"| {B} | {W} | {plain:.2f} | {comp:.2f} | {plain / comp:.2f}x | {fused:.2f} | {same} |")

if __name__ == "__main__":
    main()
