"""Long prompts joining a busy engine: running rows' longest stall, and short prompts' TTFT.

    python bench/prefill_stall.py [--model smollm2-135m] [--long 2000] [--longer 6000]
                                  [--draft-model smollm2-135m] [--only-join]

Scenario 1: 16 rows are decoding; a `--long`-token prompt joins. Reports its TTFT and the
longest step the running rows saw while it was prefilled (a step = what a running row
waits between two tokens).
Scenario 2: a `--longer`-token prompt arrives on an idle engine; 3 s later a short chat
prompt arrives. Reports the short prompt's TTFT and whether the long one was still
prefilling when the short one got its first token.
Both run the exact rows engine (EngineCore stepped on this thread; wall-clock timing), with
`--draft-model` speculating (its own prompt prefill is part of the joining work).
"""

from __future__ import annotations

import argparse
import time

from common import PROMPTS, machine_line

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.factory import build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.engine.service import warm_up
from mlx_tandem.models.loader import load


def long_prompt(model, tokens: int) -> list[int]:
    text = " ".join(PROMPTS) + " "
    ids = model.encode_text(text * (tokens // 200 + 2))
    return ids[:tokens]


def join_busy(
    model, config: RuntimeConfig, tokens: int, drafter: str | None = None
) -> tuple[float, float, float]:
    source = build_drafter(drafter, model, config) if drafter else None
    core = EngineCore(model, config, drafter=source, depth=FixedDepth(2) if source else None)
    for i in range(16):
        core.submit(model.encode(PROMPTS[i]), SamplingParams(max_tokens=4000, ignore_eos=True))
    while len(core.running) < 16:
        core.step()
    for _ in range(3):
        core.step()
    calm = []
    for _ in range(3):
        start = time.perf_counter()
        core.step()
        calm.append(time.perf_counter() - start)
    handle = core.submit(long_prompt(model, tokens), SamplingParams(max_tokens=1))
    submitted, longest = time.perf_counter(), 0.0
    while not handle.request.tokens and handle.request.finish_reason is None:
        start = time.perf_counter()
        core.step()
        longest = max(longest, time.perf_counter() - start)
    return time.perf_counter() - submitted, longest, max(calm)


def short_behind_long(model, config: RuntimeConfig, tokens: int) -> tuple[float, bool]:
    core = EngineCore(model, config)
    warm_up(core)  # as `tandem serve` starts: MLX's kernels built (a fresh machine: ~8 s)
    big = core.submit(long_prompt(model, tokens), SamplingParams(max_tokens=1))
    begin = time.perf_counter()
    short = None
    submitted = 0.0
    while short is None or not short.request.tokens:
        if short is None and time.perf_counter() - begin >= 3.0:
            short = core.submit(model.encode(PROMPTS[0]), SamplingParams(max_tokens=8))
            submitted = time.perf_counter()
        core.step()
    ttft = time.perf_counter() - submitted
    still_prefilling = not big.request.tokens and big.request.finish_reason is None
    core.cancel_all()
    return ttft, still_prefilling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--longer", type=int, default=6000)
    ap.add_argument("--draft-model", default=None, help="speculate with this drafter (join only)")
    ap.add_argument("--only-join", action="store_true", help="skip the short-behind-long scenario")
    args = ap.parse_args()
    model = load(args.model, progress=False)
    config = RuntimeConfig.resolve(max_rows=17)
    core = EngineCore(model, config)
    policy = core.prefill_policy
    print(machine_line(f"prefill under load, {model.name}"))
    print(f"chunk {policy.chunk} tokens (taper {policy.taper}: {policy.cuts.at(1900)} tokens at depth 1900), "
          f"stall target {policy.stall_s:g} s")
    ttft, longest, calm = join_busy(model, config, args.long, args.draft_model)
    with_drafter = f" (drafter {args.draft_model})" if args.draft_model else ""
    print(f"| {args.long}-token prompt joining 16 decoding rows{with_drafter} | TTFT {ttft:.2f} s | "
          f"longest step while it prefilled {longest:.2f} s (calm step {calm:.2f} s) |")
    if args.only_join:
        return
    short_ttft, overlapped = short_behind_long(model, config, args.longer)
    print(f"| short prompt 3 s after a {args.longer}-token prompt | TTFT {short_ttft:.2f} s | "
          f"long prompt still prefilling then: {overlapped} |")


if __name__ == "__main__":
    main()
