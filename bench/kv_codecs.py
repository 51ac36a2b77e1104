"""KV codecs measured: bytes per token, KL and perplexity against float KV, decode tok/s, rows
that fit a budget — on several models in one run.

Quality is teacher-forced: a held-out passage (CPython's own "Execution model" documentation,
`pydoc_data.topics`, shipped with every Python: offline and deterministic) runs through the
rows engine's runner in chunks of `--chunk` tokens, once with float K/V and once per codec, so
every later token attends to the codec's stored K/V (its own chunk included). Per position:
KL(p_float || p_codec) of the next-token distributions, and the codec's negative log-likelihood
of the real next token (perplexity). Bytes per token come from the scheduler's own measurement
(`measure_memory`: the arrays a row cache really allocates, sliding layers in the engine's ring
of window + widest append), averaged over a row of `--context` tokens; "rows @ budget" = how
many rows of `--context` tokens fit `--budget` bytes of KV. Decode tok/s: the engine (EngineCore, greedy,
EOS ignored) generating `--decode-tokens` per row for B chat prompts, median of `--repeats`
alternating rounds; "long" runs one row whose prompt is the passage (`--tokens` tokens), so the
dequantize-then-attend cost over a long cache shows.

    .venv/bin/python bench/kv_codecs.py --models smollm2-135m,gemma3-270m
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import math
import statistics
import time

import mlx.core as mx
from common import PROMPTS, machine_line

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig, parse_bytes
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.prefill import PrefillPolicy
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.engine.sampling import MAX_DRAFT
from mlx_tandem.engine.scheduler import default_budget, measure_memory
from mlx_tandem.models.loader import load

CODECS = ("fp|affine8|affine4|affine4:g32|turbo-k8v4|turbo-k4v4|turbo-k3v4|turbo-k4v4,fp-edges"
          "|turbo-k3v4,fp-edges|turbo-k4v4,fp-sliding")


def passage() -> str:
    from pydoc_data.topics import topics

    return topics["execmodel"] + "\n" + topics["exceptions"]


def log_probs(runner: ModelRunner, ids: list[int], chunk: int) -> list[mx.array]:
    """Per chunk: (L, V) float32 log-softmax of each position's next-token logits."""
    rows = runner.blank_rows(1)
    out = []
    for start in range(0, len(ids), chunk):
        piece = mx.array(ids[start : start + chunk], dtype=mx.int32)[None]
        logits = runner.logits(runner.forward(rows, piece), "all")[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp, *rows.arrays())
        out.append(lp)
    return out


def quality(
    ref: list[mx.array], got: list[mx.array], ids: list[int], chunk: int
) -> tuple[float, float]:
    """(mean KL(ref || got), perplexity of got) over every position that has a next token."""
    kl = nll = 0.0
    n = 0
    for i, (p, q) in enumerate(zip(ref, got, strict=True)):
        nxt = ids[i * chunk + 1 : (i + 1) * chunk + 1]
        m = len(nxt)
        if not m:
            continue
        p, q = p[:m], q[:m]
        kl += mx.sum(mx.exp(p) * (p - q)).item()
        nll -= mx.sum(mx.take_along_axis(q, mx.array(nxt, dtype=mx.int32)[:, None], axis=-1)).item()
        n += m
    return kl / n, math.exp(nll / n)


def decode_rate(engine: EngineCore, prompts: list[list[int]], n: int) -> float:
    """Generated tok/s once every row has joined (prefill excluded)."""
    hs = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    while not all(h.request.tokens for h in hs):
        engine.step()
    before = sum(len(h.request.tokens) for h in hs)
    start = time.perf_counter()
    engine.run_until_idle()
    done = sum(len(h.result().tokens) for h in hs)
    return (done - before) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--codecs", default=CODECS, help="'|'-separated if a name has a comma")
    ap.add_argument("--tokens", type=int, default=1025, help="passage tokens (predicted: one less)")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--decode", default="fp|affine4|turbo-k8v4|turbo-k4v4",
                    help="codecs whose decode speed is measured ('|'-separated)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default="1G")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()

    def names(text: str) -> list[str]:
        return text.split("|") if "|" in text else text.split(",")

    codecs = [c for c in names(args.codecs) if c]
    timed = [c for c in names(args.decode) if c]
    budget = parse_bytes(args.budget)
    batches = [int(b) for b in args.batches.split(",")]
    print(machine_line(f"KV codecs, passage {args.tokens} tokens in chunks of {args.chunk}, "
                       f"budget {args.budget} at {args.context} tokens/row"))
    for name in args.models.split(","):
        model = load(name, dtype="float32", progress=False)
        ids = model.encode(passage())[: args.tokens]
        runner = ModelRunner(model)
        ref = log_probs(runner, ids, args.chunk)
        policy = PrefillPolicy.resolve(model.config, RuntimeConfig.resolve(),
                                       default_budget(model), "cpu")  # fmt: skip
        reach = max(policy.chunk, MAX_DRAFT + 1)  # the engine's: sliding layers keep a ring

        def per_token(codec: str, model=model, reach=reach) -> int:
            """KV bytes per token of a row of --context tokens (rings included)."""
            runner = ModelRunner(model, kv_codec=codec)
            runner.reach = reach
            memory = measure_memory(runner)
            return (memory.row_bytes(args.context) - memory.per_row) // args.context

        base_bytes = per_token("fp")
        print(f"\n## {name} (float32 weights; float K/V = {base_bytes} B/token at "
              f"{args.context} tokens, sliding rings of window + {reach})\n")
        print("| codec | KV B/token | bits/elem | KL vs float | ppl | rows @ budget |")
        print("|---|---|---|---|---|---|")
        for codec in codecs:
            runner = ModelRunner(model, kv_codec=codec)
            got = ref if codec == "fp" else log_probs(runner, ids, args.chunk)
            kl, ppl = quality(ref, got, ids, args.chunk)
            size = per_token(codec)
            rows = budget // (size * args.context)
            bits = 32 * size / base_bytes
            print(f"| {codec} | {size} | {bits:.2f} | {kl:.4f} | {ppl:.3f} | {rows} |",
                  flush=True)
        if not timed:
            continue
        rates = decode_rates(model, timed, batches, [ids[:-1]], args)
        keys = [*map(str, batches), "long"]
        print("\n| codec | " + " | ".join(f"decode tok/s B={k}" for k in keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        fp = rates.get("fp", {})
        for codec, r in rates.items():
            cells = [f"{r[k]:.1f}" + (f" ({r[k] / fp[k]:.2f}x)" if fp and codec != "fp" else "")
                     for k in keys]
            print(f"| {codec} | {' | '.join(cells)} |", flush=True)


def decode_rates(model, timed: list[str], batches: list[int], long_ids, args) -> dict:
    """tok/s per codec and setting; the codecs alternate within each round (a shared,
    noisy machine drifts between runs), median over rounds."""
    engines = {c: EngineCore(model, RuntimeConfig.resolve(max_rows=max(batches), kv_codec=c))
               for c in timed}
    chats = [model.encode(p) for p in PROMPTS]
    settings = {str(b): chats[:b] for b in batches} | {"long": long_ids}
    got: dict[str, dict[str, list[float]]] = {c: {k: [] for k in settings} for c in timed}
    for c in timed:  # warm-up
        decode_rate(engines[c], chats[:2], 4)
    for _ in range(args.repeats):
        for key, prompts in settings.items():
            for c in timed:
                got[c][key].append(decode_rate(engines[c], prompts, args.decode_tokens))
    return {c: {k: statistics.median(v) for k, v in r.items()} for c, r in got.items()}

if __name__ == "__main__":
    main()
