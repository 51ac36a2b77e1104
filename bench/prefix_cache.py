"""Prefix cache measured: time to first token of a request sharing a long prefix with an
earlier one, cold vs warm, and whether the warm output is bit-identical to the cold one.

A shared document of `--prefix` tokens (CPython's own "Execution model" documentation,
`pydoc_data.topics`: offline and deterministic) is followed by one of several questions.
Per round, on fresh engines (EngineCore, greedy, `--max-tokens` tokens with logprobs):

  * cold, cache off  — question B alone;
  * cold, cache on   — question B alone on an empty cache (what inserting costs);
  * warm             — question A first (it fills the cache), then question B: B's TTFT.

TTFT = the request's own arrival -> first token (RequestStats), the engine stepped by hand
with nothing else running. Identity: B's tokens and every logprob (chosen and top 5) warm
== cold. Median over `--repeats` rounds (after one warm-up round).

    .venv/bin/python bench/prefix_cache.py --model smollm2-135m --prefix 1500
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import statistics

from common import machine_line

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig, parse_cache_bytes
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.models.loader import load

QUESTIONS = (
    "\n\nQuestion: what is a code block, in one sentence?\nAnswer:",
    "\n\nQuestion: which exceptions does this text name?\nAnswer:",
    "\n\nQuestion: summarise the rules for name binding.\nAnswer:",
)


def document(model, tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = model.encode_text(topics["execmodel"] + "\n" + topics["exceptions"])
    if len(ids) < tokens:
        raise SystemExit(f"the document has only {len(ids)} tokens (< --prefix {tokens})")
    return ids[:tokens]


def run(engine: EngineCore, prompt: list[int], max_tokens: int) -> tuple[float, tuple]:
    handle = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, logprobs=5))
    engine.run_until_idle()
    result = handle.result()
    assert result.stats is not None
    out = (result.tokens, [(t.logprob, t.top) for t in result.logprobs])
    return result.stats.ttft_s, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix", type=int, default=1500, help="shared prefix tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-bytes", default="2G", help="prefix cache budget (bytes, K/M/G)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: auto)")
    args = ap.parse_args()
    model = load(args.model, progress=False)
    doc = document(model, args.prefix)
    prompts = [doc + model.encode_text(q) for q in QUESTIONS]
    base = RuntimeConfig.resolve(prefill_chunk=args.chunk)
    budget = parse_cache_bytes(args.cache_bytes)
    on, off = base.with_(prefix_cache_bytes=budget), base.with_(prefix_cache_bytes=0)
    times: dict[str, list[float]] = {"cold, cache off": [], "cold, cache on": [], "warm": []}
    identical, hit_tokens, cached = True, 0, 0
    for r in range(args.repeats + 1):
        a, b = prompts[r % 3], prompts[(r + 1) % 3]
        t_off, cold = run(EngineCore(model, off), b, args.max_tokens)
        t_on, cold_on = run(EngineCore(model, on), b, args.max_tokens)
        engine = EngineCore(model, on)
        run(engine, a, args.max_tokens)
        t_warm, warm = run(engine, b, args.max_tokens)
        identical &= warm == cold == cold_on
        cache = engine.scheduler.prefix_cache
        assert cache is not None
        hit_tokens, cached = cache.stats.hit_tokens, cache.bytes
        if r:  # the first round warms up
            for name, t in zip(times, (t_off, t_on, t_warm), strict=True):
                times[name].append(t)
        print(f"round {r}: cold {t_off:.3f}s, cold+insert {t_on:.3f}s, warm {t_warm:.3f}s",
              flush=True)
    chunk = EngineCore(model, off).prefill_policy.chunk
    print(machine_line(f"prefix cache, {model.name}"))
    print(f"shared prefix {args.prefix} tokens + questions of {[len(p) - args.prefix for p in prompts]}"
          f" tokens; prefill chunk {chunk}; cached blocks hit by B: {hit_tokens} tokens; "
          f"cache holds {cached / 2**20:.1f} MiB after A and B")
    print("| run | TTFT median (s) | vs cold |")
    print("|---|---|---|")
    cold_s = statistics.median(times["cold, cache off"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {t:.3f} | {t / cold_s:.3f}× |")
    print(f"warm output bit-identical to cold (tokens and top-5 logprobs, every round): {identical}")


if __name__ == "__main__":
    main()
