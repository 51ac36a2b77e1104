"""Depth policies A/B in lockstep: engines on identical closed-loop loads, stepped alternately.

    .venv/bin/python bench/depth_ab.py --load grounded --rows 8 --requests 32 none adaptive:3 fixed:3

Each policy (`none`: no drafter; `adaptive:k` / `fixed:k`: prompt lookup at that depth
policy) gets its own EngineCore on the same loaded model, prefix cache on (as `tandem
serve`). Every engine keeps `--rows` requests in flight (a new one joins as one finishes:
the server's closed loop with that many clients) until `--requests` have run, and the
engines take one step each in turn, each step timed alone. This VM's speed drifts by
±10–30% over minutes, which buries a few percent between runs made one after the other;
stepped alternately, every engine sees the same drift. What it does not remove: two
identical engines in one run can differ by a steady ~7% at 32 rows (`adaptive:3 none none`
on the mixed load, 2026-12-05: the two `none` took 1.010x and 1.072x, then 0.996x and
1.075x, the time of adaptive, which drafted nothing) — the engine's own memory, not its
policy. Name a policy twice, as its own control, before reading a difference under ~8% at
wide batches. A warm-up round (compiles, fills the prefix caches, teaches the adaptive
policy its costs) is not reported. Greedy, EOS
ignored: every engine generates the same tokens, so time alone differs.

It reports per round and policy: seconds of steps, of which prefill, steps taken, tokens
generated (counted from the finished requests), drafted and accepted, and time relative to the first policy (below 1: faster). The
reference is our own engine without a drafter (the "speculation never costs" question);
mlx-lm's speed is `batch_throughput.py`'s and `serve_load.py`'s business.
"""

from __future__ import annotations

import argparse
import time

from common import machine_line
from serve_load import prompts

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.factory import build_depth, build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.request import RequestHandle
from mlx_tandem.models.loader import load


class Timed:
    """One policy's engine and closed-loop load; step and prefill seconds counted."""

    def __init__(self, policy: str, model, config: RuntimeConfig) -> None:
        self.policy = policy
        drafter = depth = None
        if policy != "none":
            kind, _, k = policy.partition(":")
            depth = build_depth(kind, int(k or 3))
            drafter = build_drafter("ngram", model, config)
        self.core = EngineCore(model, config, drafter=drafter, depth=depth)
        prefill = self.core._prefill

        def timed_prefill() -> bool:
            t = time.perf_counter()
            try:
                return prefill()
            finally:
                self.prefill_s += time.perf_counter() - t

        self.core._prefill = timed_prefill  # type: ignore[method-assign]
        self.run_round([], 0, 0, 0)

    def run_round(self, texts: list[list[int]], rows: int, requests: int, tokens: int) -> None:
        self.step_s = self.prefill_s = 0.0
        self.steps = self.sent = self.generated = 0
        self.live: list[RequestHandle] = []
        stats = self.core.stats
        self.start = (sum(stats.drafted.values()), sum(stats.accepted.values()))
        self.texts, self.rows, self.requests, self.tokens = texts, rows, requests, tokens

    def step(self) -> bool:
        """Top the load up to `rows` requests and take one step; False when the round is done."""
        done = [h for h in self.live if h.request.finish_reason is not None]
        self.generated += sum(len(h.request.tokens) for h in done)
        self.live = [h for h in self.live if h.request.finish_reason is None]
        while len(self.live) < self.rows and self.sent < self.requests:
            text = self.texts[self.sent % len(self.texts)]
            self.live.append(self.core.submit(text, SamplingParams(max_tokens=self.tokens, ignore_eos=True)))
            self.sent += 1
        if not self.core.busy():
            return False
        t = time.perf_counter()
        self.core.step()
        self.step_s += time.perf_counter() - t
        self.steps += 1
        return True

    def counts(self) -> tuple[int, int]:
        stats = self.core.stats
        return (sum(stats.drafted.values()) - self.start[0],
                sum(stats.accepted.values()) - self.start[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policies", nargs="*", default=["none", "adaptive:3", "fixed:3"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--load", default="grounded", choices=["chat", "grounded", "mixed"])
    ap.add_argument("--rows", type=int, default=8, help="requests in flight (clients)")
    ap.add_argument("--requests", type=int, default=32, help="requests per round and engine")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = load(args.model, progress=False)
    texts = [model.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True)
             for p in prompts(args.load)]
    config = RuntimeConfig(max_rows=args.rows, prefix_cache_bytes=None)  # as tandem serve
    engines = [Timed(p, model, config) for p in args.policies]
    print(machine_line(f"depth policies in lockstep, {args.model}, {args.load} load, "
                       f"{args.rows} rows, {args.requests} requests of {args.tokens} tokens"))
    print("| round | policy | step s | prefill s | steps | generated | drafted | accepted | "
          f"time vs {args.policies[0]} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for e in engines:
            e.run_round(texts, args.rows, args.requests, args.tokens)
        active = list(engines)
        while active:
            active = [e for e in active if e.step()]
        if rnd == 0:
            continue
        for e in engines:
            drafted, accepted = e.counts()
            print(f"| {rnd} | {e.policy} | {e.step_s:.2f} | {e.prefill_s:.2f} | {e.steps} | "
                  f"{e.generated} | {drafted} | {accepted} | {e.step_s / engines[0].step_s:.3f} |", flush=True)


if __name__ == "__main__":
    main()
