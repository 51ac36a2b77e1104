"""Shared bench helpers: prompts, timing, the machine line every result table starts with."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import mlx_tandem

# isort: split
import mlx.core as mx

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five tips for learning a new language, with one sentence each.",
    "Describe the water cycle in a paragraph.",
    "What are the main differences between cats and dogs as pets?",
    "Write a polite email asking a colleague to review a document.",
    "Summarize the plot of a heist movie you invent.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer in plain language.",
    "Write a limerick about a programmer and a bug.",
    "What should I pack for a weekend hiking trip?",
    "Describe a sunset over the ocean using vivid imagery.",
    "Explain what a binary search does, step by step.",
    "Write a dialogue between a robot and a gardener.",
    "What are three benefits of regular exercise?",
    "Invent a new board game and explain its rules briefly.",
]


def machine_line(title: str) -> str:
    return (f"# {title} — {platform.machine()} {platform.system()}, {mx.default_device()}, "
            f"BLAS {mlx_tandem.BLAS.name}, mlx-tandem {mlx_tandem.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def mlx_lm_batch(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """mlx-lm's `batch_generate`, greedy, n tokens per prompt with EOS ignored (as tandem's runs)."""
    from mlx_lm.generate import batch_generate

    eos = model.tokenizer._eos_token_ids
    model.tokenizer._eos_token_ids = set()
    try:
        out = batch_generate(model.model, model.tokenizer, prompts, max_tokens=n,
                             return_token_ids=True)
    finally:
        model.tokenizer._eos_token_ids = eos
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
