"""Prompt-lookup drafting cost: one `PromptLookupSource.draft` call for B rows of N-token contexts.

Issue 4 asks that the n-gram search not become the bottleneck at B=16 with 4k-token contexts;
compare the printed milliseconds with a decode step (BENCHMARKS.md: ~130–360 ms on this CPU).

    .venv/bin/python bench/ngram_lookup.py
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split
import statistics
import time
from types import SimpleNamespace

import numpy as np
from common import machine_line

from mlx_tandem.drafters.prompt_lookup import PromptLookupSource


def main() -> None:
    rng = np.random.default_rng(0)
    source = PromptLookupSource()
    print(machine_line("prompt lookup cost"))
    print("| rows | context tokens | ms per draft call (median of 20) |")
    print("|---|---|---|")
    for rows, tokens in ((1, 4096), (16, 1024), (16, 4096)):
        requests = [SimpleNamespace(prompt=rng.integers(0, 49152, tokens - 64).tolist(),
                                    tokens=rng.integers(0, 49152, 64).tolist())
                    for _ in range(rows)]
        times = []
        for _ in range(20):
            start = time.perf_counter()
            source.draft(requests, [4] * rows)
            times.append(time.perf_counter() - start)
        print(f"| {rows} | {tokens} | {1000 * statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
