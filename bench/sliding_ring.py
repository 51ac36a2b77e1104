"""Sliding-window layers in a ring: decode speed and KV memory of long rows, against the same
engine keeping every column, and mlx-lm's `stream_generate` (its RotatingKVCache keeps the
window too) at the same context; plus the ring row's tokens against the every-column row's.

    .venv/bin/python bench/sliding_ring.py --model gemma3-270m --context 3000

Per setting, alternating, median of `--repeats`: a row (B = 1) whose prompt is `--context`
tokens of CPython's own documentation decodes `--tokens` tokens (EOS ignored); only the
decode is timed (after the row has joined). mlx-lm's number is its own `generation_tps`.
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import statistics
import time

from common import machine_line
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.models.loader import load


def passage() -> str:
    from pydoc_data.topics import topics

    return topics["execmodel"] + topics["exceptions"] + topics["compound"]


def engine(model, ring: bool) -> EngineCore:
    core = EngineCore(model, RuntimeConfig.resolve(prefix_cache_bytes=0))
    if not ring:  # the layout before rings: sliding layers keep every column
        core.runner.reach = None
        core.rows = core.runner.empty_rows()
    return core


def tandem_rate(core: EngineCore, ids: list[int], tokens: int) -> tuple[float, int, list[int]]:
    handle = core.submit(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    while not core.running:
        core.step()
    core.step()
    held = sum(a.nbytes for a in core.rows.arrays())
    start, before = time.perf_counter(), len(handle.request.tokens)
    core.run_until_idle()
    out = handle.result().tokens
    return (len(out) - before) / (time.perf_counter() - start), held, out


def mlx_lm_rate(model, ids: list[int], tokens: int) -> float:
    responses = list(stream_generate(model.model, model.tokenizer, ids, max_tokens=tokens,
                                     sampler=make_sampler(0.0)))  # fmt: skip
    return responses[-1].generation_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = load(args.model, dtype="float32", progress=False)
    ids = model.encode_text(passage())[: args.context]
    print(machine_line(f"sliding rings, {args.model}, context {len(ids)}, {args.tokens} tokens"))
    cores = {"ring": engine(model, True), "every column": engine(model, False)}
    rates: dict[str, list[float]] = {k: [] for k in [*cores, "mlx-lm"]}
    held, outs = {}, {}
    for _ in range(args.repeats):
        for name, core in cores.items():
            rate, held[name], outs[name] = tandem_rate(core, ids, args.tokens)
            rates[name].append(rate)
        rates["mlx-lm"].append(mlx_lm_rate(model, ids, args.tokens))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print("\n| layout | decode tok/s | vs every column | vs mlx-lm | KV held by the row |")
    print("|---|---|---|---|---|")
    for name in cores:
        print(f"| {name} | {med[name]:.2f} | {med[name] / med['every column']:.2f}x | "
              f"{med[name] / med['mlx-lm']:.2f}x | {held[name] / 2**20:.0f} MiB |")
    print(f"| mlx-lm `stream_generate` | {med['mlx-lm']:.2f} | | 1.00x | |")
    print(f"\ngreedy tokens, ring == every column: {outs['ring'] == outs['every column']}")


if __name__ == "__main__":
    main()
