"""Shared bench helpers: prompts, timing, the machine line every result table starts with."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import mlx_tandem

# isort: split
import mlx.core as mx

from mlx_tandem.lab.bench import CHAT_PROMPTS, eos_ignored

PROMPTS = CHAT_PROMPTS  # the chat prompts `tandem bench` uses too


def machine_line(title: str) -> str:
    return (f"# {title} — {platform.machine()} {platform.system()}, {mx.default_device()}, "
            f"BLAS {mlx_tandem.BLAS.name}, mlx-tandem {mlx_tandem.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def mlx_lm_batch(
    model, prompts: list[list[int]], n: int, temp: float = 0.0, top_p: float = 1.0
) -> list[list[int]]:
    """mlx-lm's `batch_generate`, n tokens per prompt with EOS ignored (as tandem's runs),
    greedy or with `make_sampler(temp, top_p)`."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    with eos_ignored(model):
        out = batch_generate(model.model, model.tokenizer, prompts, max_tokens=n,
                             return_token_ids=True, sampler=make_sampler(temp, top_p))
    return out.token_ids


def timed(fn: Callable[[], int], repeats: int) -> tuple[float, int]:
    """Median seconds of fn() over repeats (after one warm-up), and the tokens it reported."""
    tokens = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens
