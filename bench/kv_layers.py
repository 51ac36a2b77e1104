"""Which layers a KV codec hurts most: per layer, the KL against float KV when that one
layer's keys get wider bits (`,kB@L`) — the sweep that picks a per-layer codec.

A codec's error is rarely spread evenly: on Gemma 3 270M one layer's 4-bit keys cost about
half of turbo-k4v4's KL. This runs the base codec, then the base codec with each attention
layer's keys at `--bits` in turn, teacher-forced over a passage (a `pydoc_data.topics` entry,
offline; pick one other than the passage you evaluate on, so the choice is not fitted to
it), and ranks the layers by how much KL each removes. Bytes per token of the base codec
and of each upgrade come from the scheduler's measurement (bench/kv_codecs.py's).

    .venv/bin/python bench/kv_layers.py --model gemma3-270m \\
        --codec turbo-k4v4,center,vcenter,eq --topic compound
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse

from common import machine_line
from kv_codecs import log_probs, quality

from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.models.loader import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--codec", default="turbo-k4v4,center,vcenter,eq")
    ap.add_argument("--bits", type=int, default=8, help="key bits of the upgraded layer")
    ap.add_argument("--topic", default="compound", help="a pydoc_data.topics entry")
    ap.add_argument("--tokens", type=int, default=1025)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    from pydoc_data.topics import topics

    model = load(args.model, dtype="float32", progress=False)
    ids = model.encode(topics[args.topic])[: args.tokens]
    print(machine_line(f"per-layer key bits, {args.model}, {args.codec}, "
                       f"topic {args.topic!r} ({len(ids)} tokens)"))
    ref = log_probs(ModelRunner(model), ids, args.chunk)
    base, _ = quality(ref, log_probs(ModelRunner(model, kv_codec=args.codec), ids, args.chunk),
                      ids, args.chunk)
    print(f"\nbase {args.codec}: KL {base:.4f}\n")
    print(f"| layer | KL with its keys at {args.bits} bits | KL removed |")
    print("|---|---|---|")
    gains = []
    for layer in range(len(model.model.layers)):
        name = f"{args.codec},k{args.bits}@{layer}"
        try:
            runner = ModelRunner(model, kv_codec=name)
        except ValueError:  # not an attention layer
            continue
        kl, _ = quality(ref, log_probs(runner, ids, args.chunk), ids, args.chunk)
        gains.append((base - kl, layer))
        print(f"| {layer} | {kl:.4f} | {base - kl:+.4f} |", flush=True)
    ranked = [layer for _, layer in sorted(gains, reverse=True)]
    print(f"\nlayers by KL removed: {ranked}")


if __name__ == "__main__":
    main()
