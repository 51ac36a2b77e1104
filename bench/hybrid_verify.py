"""Hybrid verify cost: a verify step with per-token checkpoints against a plain step, and
against the alternative rewind (restore the pre-verify snapshot, re-feed the accepted tokens).

Random-weight hybrids at real layer shapes (no hybrid checkpoint is available offline): a
Qwen3.5-0.8B-shaped stack (Gated DeltaNet 3 : 1 attention) and an LFM2-350M-shaped stack
(short convolutions + attention), with the tiny tokenizer's vocabulary (the LM head is
small, so the numbers are the layers' cost). Per B rows (prefilled with 64 tokens each):

  * plain      — one token per row (what plain decoding runs per step);
  * ckpt k     — a verify block of k+1 tokens per row: recurrent layers step token by token
                 (kv/recurrent.py) keeping per-token checkpoints, all slots' logits, then
                 each row rewinds to a seeded accepted count (one gather per state array);
  * refeed k   — the same verify forward, then each row restores the pre-verify snapshot
                 and re-feeds its accepted tokens (a second, ragged forward);
  * block k    — the verify forward with mlx-lm's block arithmetic in the recurrent layers
                 (NOT exact, and no per-row rewind: the cost stepping adds, for reference).

Median of --repeats timed runs after one warm-up, each on a fresh clone of the prefilled
rows, everything evaluated. A second table: B short prompts (64 tokens, ragged by 3) prefilled
together in one forward, in mlx-lm's block form (what the engine runs, `prefill=True`) and
stepped token by token (what it would cost to step prefill too).

    .venv/bin/python bench/hybrid_verify.py
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from common import machine_line

from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.kv import routing
from mlx_tandem.kv.state_rows import StateRows
from mlx_tandem.models.loader import LoadedModel, load_folder
from mlx_tandem.models.tiny import make_tiny_model

SHAPES = {  # make_tiny_model overrides: real layer shapes, fewer layers
    "qwen3_5": {
        "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 3584,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_value_heads": 16, "linear_num_key_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "full_attention_interval": 4,
    },
    "lfm2": {
        "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 4608,
        "block_dim": 1024, "block_ff_dim": 4608, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 64,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention",
                        "conv", "full_attention"],
    },
}  # fmt: skip


def model(arch: str, folder: Path) -> LoadedModel:
    return load_folder(make_tiny_model(arch, folder / arch, **SHAPES[arch]), arch)


def prefilled(runner: ModelRunner, B: int, n: int = 64) -> StateRows:
    rng = random.Random(0)
    rows = runner.empty_rows()
    parts = []
    for _ in range(B):
        row = runner.blank_rows(1)
        runner.prefill(row, [rng.randrange(3, 250) for _ in range(n)], n)
        parts.append(row)
    rows.prepare_append(parts).commit()
    mx.eval(*rows.arrays())
    return rows


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def steps(runner: ModelRunner, block: ModelRunner, base: StateRows, k: int, seed: int):
    B = base.row_count
    rng = random.Random(seed)
    ids = mx.array([[rng.randrange(3, 250) for _ in range(k + 1)] for _ in range(B)])
    accepted = [rng.randrange(k + 1) for _ in range(B)]

    def plain() -> None:
        rows = base.clone()
        logits = runner.logits(runner.forward(rows, ids[:, :1]), "last")
        mx.eval(logits, *rows.arrays())

    def ckpt() -> None:
        rows = base.clone()
        before = rows.ends
        logits = runner.logits(runner.forward(rows, ids), "all")
        mx.eval(logits)  # verification reads the logits before the rewind
        rows.set_ends([e + a + 1 for e, a in zip(before, accepted, strict=True)])
        mx.eval(*rows.arrays())

    def refeed() -> None:
        rows = base.clone()
        snapshot = rows.clone()
        logits = runner.logits(runner.forward(rows, ids), "all")
        mx.eval(logits)
        rows = snapshot  # the pre-verify state; re-feed each row's accepted tokens
        width = max(accepted) + 1
        runner.forward(rows, ids[:, :width], [a + 1 for a in accepted])
        mx.eval(*rows.arrays())

    def block_arith() -> None:
        rows = base.clone()
        logits = block.logits(block.forward(rows, ids), "all")
        mx.eval(logits, *rows.arrays())

    return plain, ckpt, refeed, block_arith


def prefill_costs(runner: ModelRunner, B: int, repeats: int, n: int = 64) -> tuple[float, float]:
    rng = random.Random(B)
    ids = mx.array([[rng.randrange(3, 250) for _ in range(n)] for _ in range(B)])
    lengths = [n - 3 * i for i in range(B)]

    def run(prefill: bool) -> None:
        rows = runner.blank_rows(B)
        hidden = runner.forward(rows, ids, lengths, prefill=prefill)
        mx.eval(hidden, *rows.arrays())

    return timed(lambda: run(True), repeats), timed(lambda: run(False), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="qwen3_5,lfm2")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--depths", default="2,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-batches", default="1,4")
    args = ap.parse_args()
    print(machine_line("hybrid verify: per-token checkpoints vs plain step vs snapshot+re-feed"))
    print("| model | B | plain ms | k | ckpt ms | ckpt/plain | refeed ms | refeed/ckpt "
          "| block ms (inexact) | ckpt/block |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            m = model(arch, Path(tmp))
            runner = ModelRunner(m)
            stepwise = routing.is_recurrent_module
            routing.is_recurrent_module = lambda module: False  # a copy with block recurrence
            try:
                block = ModelRunner(m)
            finally:
                routing.is_recurrent_module = stepwise
            for B in (int(b) for b in args.batches.split(",")):
                base = prefilled(runner, B)
                plain_s = None
                for k in (int(d) for d in args.depths.split(",")):
                    plain, ckpt, refeed, block_arith = steps(runner, block, base, k, seed=B * k)
                    plain_s = plain_s or timed(plain, args.repeats)
                    c, r, b = (timed(f, args.repeats) for f in (ckpt, refeed, block_arith))
                    print(f"| {arch} | {B} | {plain_s * 1e3:.1f} | {k} | {c * 1e3:.1f} | "
                          f"{c / plain_s:.2f} | {r * 1e3:.1f} | {r / c:.2f} | {b * 1e3:.1f} | "
                          f"{c / b:.2f} |", flush=True)  # fmt: skip
        print()
        print("| model | B | ragged prefill, 64 tokens: block s | stepped s | stepped/block |")
        print("|---|---|---|---|---|")
        for arch in args.archs.split(","):
            runner = ModelRunner(model(arch, Path(tmp)))
            for B in (int(b) for b in args.prefill_batches.split(",")):
                block_s, step_s = prefill_costs(runner, B, max(1, args.repeats // 2))
                print(f"| {arch} | {B} | {block_s:.2f} | {step_s:.2f} | {step_s / block_s:.2f} |",
                      flush=True)  # fmt: skip
    mx.clear_streams()


if __name__ == "__main__":
    main()
