"""`tandem bench`: what tandem buys a user — tandem and mlx-lm side by side on one model.

Loads the model once, builds every engine, then measures each configuration
(lab/bench.py says which and how) under a progress bar; prints a table of
mlx-lm tok/s, tandem tok/s and their ratio (plus acceptance for speculative
rows), writes a PNG chart of tok/s per configuration (`--chart`), and with
`--json` prints the results as one JSON object instead of the table.

    tandem bench --model smollm2-135m --quick

Oracle: tests/test_bench_cli.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from mlx_tandem.cli.options import add_model_flags

DEFAULT_CHART = "tandem-bench.png"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark tandem against mlx-lm on this machine")
    add_model_flags(p)
    p.add_argument("--tokens", type=int, default=None,
                   help="new tokens per prompt, EOS ignored (default 64; 32 with --quick)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds per configuration, median reported (default 3; 1 with "
                   "--quick)")
    p.add_argument("--quick", action="store_true",
                   help="fewer prompts, tokens and configurations (B=4 only): a few minutes")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="k: self-draft drafts k tokens, ngram/assistant up to k (default 3)")
    p.add_argument("--draft-depth", choices=("fixed", "adaptive"), default=None,
                   help="depth policy of the ngram and assistant rows (default adaptive)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--chart", default=None,
                   help=f"PNG chart of tok/s per configuration (default {DEFAULT_CHART} where "
                   "matplotlib is installed, the [lab] extra; 'none' writes none)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mlx_tandem.lab.bench import BenchSettings

    settings = BenchSettings.preset(
        args.quick, tokens=args.tokens, repeats=args.repeats,
        draft_tokens=args.num_draft_tokens, draft_depth=args.draft_depth,
    )
    plotting = find_spec("matplotlib") is not None
    asked = args.chart if args.chart is not None else DEFAULT_CHART if plotting else "none"
    chart = None if asked.lower() in ("", "none") else Path(asked).expanduser()
    if chart is not None and not plotting:
        raise RuntimeError("--chart needs matplotlib: pip install 'mlx-tandem[lab]' "
                           "(or pass --chart none)")
    if chart is not None and not chart.parent.is_dir():
        raise FileNotFoundError(f"--chart folder does not exist: {chart.parent}")
    results = measure_all(args, settings)
    if chart is not None:
        write_chart(results, chart)
        results["chart"] = str(chart)
    if args.json:
        print(json.dumps(results))
    else:
        print_table(results)
        if not plotting:
            print("\nno chart: pip install 'mlx-tandem[lab]' for matplotlib")
    return 0


def measure_all(args: argparse.Namespace, settings: Any) -> dict[str, Any]:
    from tqdm import tqdm

    from mlx_tandem import BLAS
    from mlx_tandem.lab.bench import (
        Summary,
        build_engines,
        encode_prompts,
        machine,
        measure,
        plan,
    )
    from mlx_tandem.models.loader import load

    say = (lambda _: None) if args.json else (lambda text: print(text, file=sys.stderr))
    model = load(args.model, dtype=args.dtype, progress=not args.json)
    say(f"building engines for {model.name} ({model.dtype}) ...")
    engines = build_engines(model, settings)
    chat, copy = encode_prompts(model)
    configs = plan(model, engines, settings, chat, copy)
    done: dict[str, Summary] = {}
    rows = []
    bar = tqdm(configs, desc="bench", unit="config", file=sys.stderr, leave=False)
    for config in bar:
        bar.set_postfix_str(config.name)
        rows.append(measure(config, settings, done))
    bar.close()
    return {
        "model": model.name,
        "dtype": model.dtype,
        "settings": {**asdict(settings), "quick": args.quick},
        "machine": {**machine(), "blas": BLAS.name},
        "configurations": [asdict(r) for r in rows],
    }


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_table(results: dict[str, Any]) -> None:
    s, m = results["settings"], results["machine"]
    print(f"# tandem bench — {results['model']} {results['dtype']}, {s['tokens']} new tokens per "
          f"prompt (greedy, EOS ignored), median of {s['repeats']}; {m['platform']}, "
          f"{m['device']}, BLAS {m['blas']}, mlx-lm {m['mlx_lm']}, mlx-tandem {m['mlx_tandem']}")
    header = ("configuration", "mlx-lm tok/s", "tandem tok/s", "ratio", "acceptance",
              "tok/forward")
    lines = [header]
    for r in results["configurations"]:
        lines.append((
            r["name"], _num(r["mlx_lm_tps"], ".1f"), _num(r["tandem_tps"], ".1f"),
            _num(r["ratio"], ".2f", "x"), _num(r["acceptance"], ".2f"),
            _num(r["tokens_per_forward"], ".2f"),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:],
                                                                          strict=True)]
        print("  ".join(cells))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print()
    for r in results["configurations"]:
        if r["skipped"]:
            print(f"{r['name']}: skipped — {r['note']}")
        else:
            print(f"{r['name']}: mlx-lm {r['mlx_lm']} vs tandem {r['tandem']}")
    if "chart" in results:
        print(f"\nchart: {results['chart']}")


def write_chart(results: dict[str, Any], path: Path) -> None:
    """Grouped horizontal bars, mlx-lm and tandem tok/s per configuration, ratio at the end."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in results["configurations"] if not r["skipped"]]
    names = [r["name"] for r in rows]
    fig = Figure(figsize=(9, 1.2 + 0.45 * max(1, len(rows))), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg backend, no pyplot and no display
    ax = fig.add_subplot()
    ys = range(len(rows))
    h = 0.38
    ax.barh([y - h / 2 for y in ys], [r["mlx_lm_tps"] for r in rows], h, label="mlx-lm",
            color="#9aa5b1")
    ax.barh([y + h / 2 for y in ys], [r["tandem_tps"] for r in rows], h, label="tandem",
            color="#2b7bb9")
    for y, r in zip(ys, rows, strict=True):
        ax.text(max(r["mlx_lm_tps"], r["tandem_tps"]), y, f"  {r['ratio']:.2f}x",
                va="center", fontsize=8)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens per second (higher is better)")
    ax.margins(x=0.12)
    s = results["settings"]
    ax.set_title(f"tandem vs mlx-lm — {results['model']} {results['dtype']}, "
                 f"{s['tokens']} tokens/prompt, {results['machine']['device']}", fontsize=10)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    fig.savefig(path, format="png", dpi=120)
