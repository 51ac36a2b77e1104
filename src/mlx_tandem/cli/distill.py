"""`tandem distill`: train an assistant drafter for a target (the lab, lab/distill.py).

    tandem distill --target smollm2-135m            # corpus, training, ~45 min here
    tandem generate --draft-model assistant ...     # then use it

Oracle: tests/test_lab.py (flags reach the lab; the written folder loads as a drafter).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from mlx_tandem.cli.options import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from mlx_tandem.lab.distill import PROMPT_SOURCES, DistillOptions, default_folder, distill
from mlx_tandem.lab.train import TrainConfig
from mlx_tandem.models.loader import DTYPES, load


def register(sub: argparse._SubParsersAction) -> None:
    defaults, train = DistillOptions(), TrainConfig()
    p = sub.add_parser(
        "distill",
        help="train an assistant drafter for a target (its own answers to ShareGPT prompts or "
        "to prompts it writes)",
    )
    p.add_argument("--target", required=True, help="target model (folder, .gguf, catalogue name)")
    p.add_argument("--out", default=None, help="output folder (default: the assistants home, "
                   "where `--draft-model assistant` finds it)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the target's weights while training (as `tandem generate --dtype`)")
    for flag, default, help_ in (
        ("--layers", defaults.layers, "the assistant's Q-only layers"),
        ("--width", defaults.width, "the assistant's hidden width"),
        ("--intermediate", defaults.intermediate, "the assistant's MLP width"),
        ("--vocab", defaults.vocab, "draft vocabulary: the target's most frequent reply tokens"),
        ("--depth", train.depth, "draft steps unrolled in training"),
    ):
        p.add_argument(flag, type=positive_int, default=default, help=help_)
    p.add_argument("--minutes", type=positive_float, default=train.minutes,
                   help="training time (resumed runs count earlier time)")
    p.add_argument("--data-minutes", type=non_negative_float, default=defaults.data_minutes,
                   help="time for growing the corpus this run: writing prompts (--prompt-source "
                   "self) and answering them (0: use the corpus as is)")
    p.add_argument("--prompts", type=positive_int, default=defaults.prompts,
                   help="corpus size: prompts of --prompt-source answered by the target (in a fixed "
                   "order)")
    p.add_argument("--prompt-source", choices=PROMPT_SOURCES, default=defaults.prompt_source,
                   help="sharegpt: ShareGPT's first human turns; self: user turns the target "
                   "writes itself from its chat template (Magpie), sampled with --seed")
    p.add_argument("--first-prompt", type=non_negative_int, default=defaults.first_prompt,
                   help="start the corpus at this prompt of the fixed order (continuing an "
                   "--init assistant on prompts it never saw)")
    p.add_argument("--dataset-replies", type=non_negative_int, default=defaults.dataset_replies,
                   help="also train on ShareGPT's own replies to this many other prompts "
                   "(teacher-forced; the loss is still the target's distribution)")
    p.add_argument("--init", default=None, metavar="FOLDER",
                   help="continue training this assistant (its shape and draft vocabulary win "
                   "over --layers/--width/--intermediate/--vocab); a checkpoint in --out wins "
                   "over it")
    p.add_argument("--max-steps", type=non_negative_int, default=0,
                   help="also stop training after this many steps (0: the time budget only)")
    p.add_argument("--max-tokens", type=positive_int, default=defaults.max_tokens,
                   help="tokens of each answer the target writes for the corpus")
    p.add_argument("--lr", type=positive_float, default=train.lr, help="peak learning rate")
    p.add_argument("--batch-tokens", type=positive_int, default=train.batch_tokens,
                   help="tokens per training batch")
    p.add_argument("--seed", type=int, default=train.seed,
                   help="data order, initial weights, held-out split, self-written prompts")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    init = Path(args.init).expanduser() if args.init else None
    if init is not None and not (init / "config.json").is_file():
        raise ValueError(f"--init {args.init}: no assistant there (no config.json)")
    target = load(args.target, dtype=args.dtype)
    out = Path(args.out).expanduser() if args.out else default_folder(target.name)
    train = TrainConfig(depth=args.depth, minutes=args.minutes, seed=args.seed, lr=args.lr,
                        batch_tokens=args.batch_tokens, max_steps=args.max_steps)
    opts = DistillOptions(
        layers=args.layers, width=args.width, intermediate=args.intermediate, vocab=args.vocab,
        prompts=args.prompts, prompt_source=args.prompt_source, first_prompt=args.first_prompt,
        max_tokens=args.max_tokens, data_minutes=args.data_minutes,
        dataset_replies=args.dataset_replies, init=init,
        train=train, command="tandem " + shlex.join(args.argv),
    )
    bars: list[tqdm] = []  # opened by the first report: no bar before training starts
    shown = {"alpha": "-"}

    def report(entry: dict) -> None:
        if not bars:
            bars.append(tqdm(total=round(args.minutes * 60), unit="s", desc="training",
                             leave=True))
        bar = bars[0]
        if "alpha" in entry:
            shown["alpha"] = "/".join(f"{a:.2f}" for a in entry["alpha"])
            shown["tau"] = f"{entry['tokens_per_forward']:.2f}"
        bar.n = min(bar.total, round(entry["s"]))
        bar.set_postfix(step=entry["step"], loss=f"{entry['loss']:.3f}", **shown)

    summary = distill(target, out, opts, say=tqdm.write, report=report)
    for bar in bars:
        bar.close()
    alpha = "/".join(f"{a:.2f}" for a in summary["held_out_alpha"])
    print(
        f"assistant for {target.name}: held-out acceptance {alpha} per position, "
        f"{summary['held_out_tokens_per_forward']:.2f} tokens per target forward at depth "
        f"{args.depth}; written to {out}"
    )
    return 0
