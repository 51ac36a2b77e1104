"""Batched decoding throughput: mlx-tandem's rows engine vs mlx-lm's `batch_generate`.

Same process, same loaded model, same chat-templated prompts, greedy (or, with `--temp`,
sampled: seeded rows here, mlx-lm's `make_sampler` there), N new tokens per prompt (EOS
ignored on both sides so every row does the same work).
Engines are built (probes, memory measurement) before any clock starts; the
timed region is submit -> every request finished; each B reports the median of
`--repeats` rounds that alternate mlx-lm and the two tandem engines.
Reports total generated tok/s at B = 1, 4, 8, 16 and the tandem/mlx-lm ratio,
for the default batch-invariant engine and with TANDEM_BATCH_INVARIANT=0, plus
the time to first token of a request that joins a busy batch of 8.

    .venv/bin/python bench/batch_throughput.py --model smollm2-135m --tokens 64 [--temp 0.7]
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import statistics
import time
from collections.abc import Callable

from common import PROMPTS, machine_line, mlx_lm_batch

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.models.loader import load


def tandem_run(engine: EngineCore, prompts, n: int, temp: float = 0.0, top_p: float = 1.0) -> int:
    handles = [
        engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=temp,
                                        top_p=top_p, seed=i))
        for i, p in enumerate(prompts)
    ]
    engine.run_until_idle()
    return sum(len(h.result().tokens) for h in handles)


def mlx_lm_run(model, prompts, n: int, temp: float = 0.0, top_p: float = 1.0) -> int:
    return sum(len(t) for t in mlx_lm_batch(model, prompts, n, temp, top_p))


def join_ttft(engine: EngineCore, prompts, n: int) -> float:
    """Seconds from submit to first token for a request joining 8 running rows."""
    for p in prompts[:8]:
        engine.submit(p, SamplingParams(max_tokens=n * 4, ignore_eos=True))
    for _ in range(12):
        engine.step()
    start = time.perf_counter()
    late = engine.submit(prompts[8], SamplingParams(max_tokens=4, ignore_eos=True))
    while not late.request.tokens:
        engine.step()
    ttft = time.perf_counter() - start
    engine.cancel_all()
    return ttft


def alternating(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median tok/s per run over `repeats` rounds that alternate the runs (after one warm-up)."""
    for run in runs.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run()
            rates[name].append(tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy rows")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    model = load(args.model, dtype=args.dtype, progress=False)
    prompts = [model.encode(p) for p in PROMPTS]
    picks = "greedy" if args.temp == 0 else f"temp {args.temp}, top-p {args.top_p}"
    print(machine_line(f"batch throughput, {args.model} {model.dtype}, {args.tokens} tokens/row, "
                       f"{picks}"))
    print("| B | mlx-lm tok/s | tandem tok/s | ratio | tandem (invariance off) tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    engines = {
        invariant: EngineCore(model, RuntimeConfig.resolve(max_rows=16, batch_invariant=invariant))
        for invariant in (True, False)
    }
    picking = (args.temp, args.top_p)
    for b in [int(x) for x in args.batches.split(",")]:
        batch = prompts[:b]
        runs = {
            "ref": lambda batch=batch: mlx_lm_run(model, batch, args.tokens, *picking),
            "inv": lambda batch=batch: tandem_run(engines[True], batch, args.tokens, *picking),
            "off": lambda batch=batch: tandem_run(engines[False], batch, args.tokens, *picking),
        }
        rate = alternating(runs, args.repeats)
        ref, inv, off = rate["ref"], rate["inv"], rate["off"]
        print(f"| {b} | {ref:.1f} | {inv:.1f} | {inv / ref:.2f}x | {off:.1f} | {off / ref:.2f}x |",
              flush=True)
    print(f"\nTTFT of a request joining 8 running rows (tandem): "
          f"{join_ttft(engines[True], prompts, args.tokens):.2f} s")


if __name__ == "__main__":
    main()
