"""`tandem models`: the built-in catalogue, what is fetched and what is prepared, and which
model families the rows engine runs (models/families.py). Any mlx-lm folder, .gguf file or
Hugging Face repo id loads too.

Oracle: tests/test_cli.py (test_doctor_and_models), tests/test_families.py.
"""

from __future__ import annotations

import argparse

from mlx_tandem.models import catalogue
from mlx_tandem.models.families import FAMILIES
from mlx_tandem.models.loader import prepared_models


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list catalogue models and prepared conversions")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    prepared = prepared_models()
    print(f"catalogue (home: {catalogue.tandem_home()}):")
    for entry in catalogue.CATALOGUE.values():
        fetched = catalogue.gguf_path(entry).exists()
        dtypes = [
            p.name.removeprefix(entry.name + "-")
            for p in prepared
            if p.name.startswith(entry.name + "-")
        ]
        state = "fetched" if fetched else "not fetched"
        ready = f"; prepared: {', '.join(dtypes)}" if dtypes else ""
        default = " (default)" if entry.name == catalogue.DEFAULT_MODEL else ""
        print(f"  {entry.name:<14} {entry.description}{default} [{state}{ready}]")
    others = [
        p for p in prepared if not any(p.name.startswith(e + "-") for e in catalogue.CATALOGUE)
    ]
    if others:
        print("other prepared models:")
        for p in others:
            print(f"  {p}")
    print("model families (mlx-lm model_type: what the rows engine runs):")
    for f in FAMILIES.values():
        batched = "batched ✓" if f.batched is None else f"rows engine ✗ (plain path only): {f.batched}"
        spec = "" if f.batched else "speculation ✓" if f.speculation is None else "no speculation"
        print(f"  {f.name:<12} {batched}{'  ' + spec if spec else ''}")
    return 0
