"""Where a rows-engine decode step spends its time, per batch size (plain decoding, no drafter).

    python bench/profile_step.py [--model smollm2-135m] [--batches 1 4 8 16] [--steps 20]
                                 [--temp 0.7 --top-p 0.9]

Rows decode greedily unless `--temp` > 0: then every row samples (seeded) with that
temperature and top-p, and mlx-lm's step samples with `make_sampler` of the same settings.

Per B it reports, in ms per step:
  * step      — EngineCore.step() as the engine runs it (one host read per step);
  * forward   — the target forward (embeddings, layers, norm), evaluated on its own;
  * attention — the share of `forward` spent in the batch-invariant attention (a separate
                pass: each layer's attention timed on its own, its inputs evaluated first);
  * padding   — forward with batch invariance on minus off (projections' row padding and the
                invariant attention's fixed shapes cost this much);
  * head      — the LM head as the step uses it: the certified greedy picks' one fast call
                where the engine makes it (exact logits then only for unsure rows, inside
                verify), else the exact logits over the verified slots;
  * verify    — sampling/acceptance including its host read;
  * host      — the rest of the phased step: building inputs, ends, postprocess, text.
Phases are measured by evaluating at their boundaries, which removes the overlap the real
step gets; `step` is the honest total. mlx-lm's batch decode step on the same rows is timed
the same way (its BatchKVCache, fused attention) for the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from common import PROMPTS, machine_line

# isort: split
import mlx.core as mx

from mlx_tandem import SamplingParams
from mlx_tandem.engine import core as core_module
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.models.loader import load


def ready_core(
    model, B: int, invariant: bool, temp: float = 0.0, top_p: float = 1.0
) -> EngineCore:
    """A core with B rows decoding (prompts prefilled, a few warm-up steps taken)."""
    core = EngineCore(model, RuntimeConfig.resolve(max_rows=B, batch_invariant=invariant))
    for i in range(B):
        prompt = model.encode(PROMPTS[i % len(PROMPTS)])
        params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=temp,
                                top_p=top_p, seed=i)
        core.submit(prompt, params)
    while len(core.running) < B:
        core.step()
    for _ in range(3):
        core.step()
    return core


class Timer:
    """Wraps callables so each call is evaluated and its seconds added to a named bucket."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable, inputs_first: bool = False) -> Callable:
        """`inputs_first`: evaluate the array arguments before the clock starts, so the
        bucket holds fn's own work and not the pending graph that produces its inputs."""

        def timed(*args, **kwargs):
            if inputs_first:
                mx.eval([a for a in (*args, *kwargs.values()) if isinstance(a, mx.array)])
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(out)
            self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - start
            return out

        return timed


def step_ms(core: EngineCore, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def phases(core: EngineCore, steps: int) -> dict[str, float]:
    """Seconds per phase. `head`: what the step's verify reads from the LM head — the
    certified picks' one fast call where the engine makes it (the exact logits stay lazy
    and are computed, inside `verify`, only for unsure rows), else the exact logits."""
    timer = Timer()
    runner = core.runner
    forward, certified, verify = runner.forward, core._certified, core_module.verify
    runner.forward = timer.wrap("forward", forward)

    def picks(*args):
        start = time.perf_counter()
        found = certified(*args)
        if found is not None:
            mx.eval(found.picks, found.unsure)
        timer.total["head"] = timer.total.get("head", 0.0) + time.perf_counter() - start
        return found

    verify_alone = timer.wrap("verify", verify)

    def timed_verify(requests, logits, *args):
        if len(args) < 4 or args[3] is None:  # no certified picks: verify reads the logits
            start = time.perf_counter()
            mx.eval(logits)
            timer.total["head"] = timer.total.get("head", 0.0) + time.perf_counter() - start
        return verify_alone(requests, logits, *args)

    core._certified = picks  # type: ignore[method-assign]
    core_module.verify = timed_verify
    start = time.perf_counter()
    try:
        for _ in range(steps):
            core.step()
    finally:
        runner.forward, core_module.verify = forward, verify
        del core._certified
    wall = time.perf_counter() - start
    out = {k: 1000 * v / steps for k, v in timer.total.items()}
    out["host"] = 1000 * wall / steps - sum(out.values())
    return out


def attention_ms(core: EngineCore, steps: int) -> float:
    timer = Timer()
    attend = RowKVCache.attend
    RowKVCache.attend = timer.wrap("attention", attend, inputs_first=True)
    try:
        for _ in range(steps):
            core.step()
    finally:
        RowKVCache.attend = attend
    return 1000 * timer.total.get("attention", 0.0) / steps


def mlx_lm_step_ms(model, B: int, steps: int, temp: float = 0.0, top_p: float = 1.0) -> float:
    """mlx-lm's batched decode step (BatchKVCache, fused attention) over B left-padded prompts,
    its tokens picked as `batch_generate` picks them (log-softmax, then `make_sampler`'s)."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp, top_p)

    def pick(logits: mx.array) -> mx.array:
        logprobs = logits[:, -1] - mx.logsumexp(logits[:, -1], axis=-1, keepdims=True)
        return sampler(logprobs)[:, None]

    prompts = [model.encode(PROMPTS[i % len(PROMPTS)]) for i in range(B)]
    width = max(len(p) for p in prompts)
    padding = [width - len(p) for p in prompts]
    ids = mx.array([[0] * pad + p for p, pad in zip(prompts, padding, strict=True)])
    cache = [BatchKVCache(padding) for _ in make_prompt_cache(model.model)]
    token = pick(model.model(ids, cache=cache))
    mx.eval(token)
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        token = pick(model.model(token, cache=cache))
        token.tolist()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--temp", type=float, default=0.0, help="0 = greedy rows")
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    model = load(args.model, dtype=args.dtype, progress=False)
    picks = "greedy" if args.temp == 0 else f"sampled, temp {args.temp}, top-p {args.top_p}"
    print(machine_line(f"rows-engine step profile, {model.name} ({model.dtype}), {picks}"))
    cols = ("B", "step", "mlx-lm", "ratio", "forward", "attention", "padding", "head",
            "verify", "host")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for B in args.batches:
        core = ready_core(model, B, True, args.temp, args.top_p)
        total = step_ms(core, args.steps)
        split = phases(core, args.steps)
        attn = attention_ms(core, max(3, args.steps // 4))
        loose = ready_core(model, B, False, args.temp, args.top_p)
        padding = split["forward"] - phases(loose, args.steps)["forward"]
        theirs = mlx_lm_step_ms(model, B, args.steps, args.temp, args.top_p)
        row = [B, total, theirs, theirs / total, split["forward"], attn, padding,
               split.get("head", 0.0), split["verify"], split["host"]]
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row)
              + " |", flush=True)
    print("(ms per decode step; ratio = mlx-lm step / tandem step, > 1 means tandem is faster)")


if __name__ == "__main__":
    main()
