"""Plain (single-row) generation: the reference path every other engine is checked against.

`decode_steps` mirrors mlx-lm's `generate_step` exactly — prefill all but the
last prompt token in `prefill_step_size` chunks, then one-token steps with the
next step queued (`async_eval`) before the current token is read (on the compiled
path the first token is read first, then the segments are traced) — but runs
through the graph binding and the keyed per-row sampler.
For families `compiled_step` covers (llama, gemma3_text) a one-token step runs as
compiled segments between the attentions (same primitives, same order; faster on this
CPU, see docs/BENCHMARKS.md); `compiled=False` keeps the eager step.
`stream_generate` / `generate` add text, stop strings, EOS, logprobs, timing.

Oracle: tests/test_generate_parity.py (tokens and per-step logprobs
bit-identical to mlx-lm `generate_step` on tiny llama/qwen3/gemma3, compiled and
eager, and on real SmolLM2), tests/test_goldens.py (llama.cpp greedy tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_tandem.engine.compiled_step import compiled_step
from mlx_tandem.engine.output import TokenLogprob, top_logprobs
from mlx_tandem.engine.request import new_request
from mlx_tandem.engine.sampling import RowSampler, SamplingParams
from mlx_tandem.models.graph import MlxLmGraph
from mlx_tandem.models.loader import LoadedModel


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    ttft_s: float = 0.0
    peak_memory_gb: float = 0.0


@dataclass
class GenerationChunk:
    """One streamed piece: the text released by this token (may be empty)."""

    text: str
    token: int | None
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] = field(default_factory=list)


def decode_steps(
    graph: MlxLmGraph,
    prompt: list[int],
    sampler: RowSampler,
    max_tokens: int,
    prefill_step_size: int = 2048,
    cache: list[Any] | None = None,
    compiled: bool = True,
) -> Iterator[tuple[int, mx.array]]:
    """Yield (token, logprobs (1, V)) for up to max_tokens steps; the caller stops early."""
    cache = graph.make_cache() if cache is None else cache
    history = mx.array(prompt, dtype=mx.uint32) if sampler.needs_history else None
    position = len(prompt)
    fast = compiled_step(graph, cache) if compiled else None

    def step(ids: mx.array, position: int) -> tuple[mx.array, mx.array]:
        # the first step stays eager: tracing the segments does not delay the first token
        if fast is not None and position > len(prompt):
            logits = fast(ids[None], cache)
        else:
            hidden = graph.forward_hidden(ids[None], cache)
            logits = graph.project_logits(hidden, "last")[:, -1, :]
        logprobs = sampler.logprobs(logits, history)
        return sampler.sample(logprobs, position), logprobs

    done = 0
    while len(prompt) - done > 1:
        n = min(prefill_step_size, len(prompt) - done - 1)
        graph.forward_hidden(mx.array(prompt[done : done + n])[None], cache)
        mx.eval([c.state for c in cache])
        done += n
        mx.clear_cache()
    y, logprobs = step(mx.array(prompt[done:]), position)
    mx.async_eval(y, logprobs)
    for n in range(max_tokens):
        first_out = n == 0 and fast is not None  # trace the segments after the first token
        if first_out:
            yield y.item(), logprobs
        if n + 1 < max_tokens:
            if history is not None:
                history = mx.concatenate([history, y.astype(mx.uint32)])
            next_y, next_logprobs = step(y, position + 1)
            mx.async_eval(next_y, next_logprobs)
        if not first_out:
            yield y.item(), logprobs
        if n % 256 == 255:
            mx.clear_cache()
        if n + 1 < max_tokens:
            y, logprobs = next_y, next_logprobs
            position += 1


def stream_generate(
    model: LoadedModel,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    *,
    prefill_step_size: int = 2048,
    **overrides: Any,
) -> Iterator[GenerationChunk]:
    """Generate text for one prompt (a string is encoded as-is, ids are used as given)."""
    params = _params(params, overrides)
    if type(prefill_step_size) is not int or prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be a positive int, got {prefill_step_size!r}")
    prompt = model.encode_text(prompt)
    request = new_request(model, prompt, params)  # the rows engine's validation and finish rule
    output = request.output
    stats = GenerationStats(prompt_tokens=len(prompt))
    start = time.perf_counter()
    first = start
    steps = decode_steps(model.graph, prompt, request.sampler, params.max_tokens, prefill_step_size)
    for n, (token, logprobs) in enumerate(steps):
        if n == 0:
            first = time.perf_counter()
            stats.ttft_s = first - start
            stats.prompt_tps = len(prompt) / max(stats.ttft_s, 1e-9)
        delta, emitted = output.add(token)
        wanted = emitted and params.logprobs
        info = top_logprobs(logprobs, token, params.logprobs) if wanted else None
        stats.generation_tokens = output.count
        finish = output.finish_reason
        if finish is None:
            yield GenerationChunk(delta, token, info)
            continue
        elapsed = time.perf_counter() - first
        after_first = max(0, stats.generation_tokens - 1)  # the first token's time is TTFT
        stats.generation_tps = after_first / elapsed if elapsed > 0 else 0.0
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        yield GenerationChunk(delta, token if emitted else None, info, finish, stats)
        steps.close()
        return


def generate(
    model: LoadedModel,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    **overrides: Any,
) -> GenerationResult:
    """Run `stream_generate` to the end and collect text, tokens, logprobs and stats."""
    prefill_step_size = overrides.pop("prefill_step_size", 2048)
    params = _params(params, overrides)
    prompt = model.encode_text(prompt)
    pieces: list[str] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    for chunk in stream_generate(model, prompt, params, prefill_step_size=prefill_step_size):
        pieces.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.logprob is not None:
            logprobs.append(chunk.logprob)
        if chunk.finish_reason is not None:
            assert chunk.stats is not None
            return GenerationResult(
                "".join(pieces), tokens, prompt, chunk.finish_reason, chunk.stats, logprobs
            )
    raise AssertionError("stream_generate ended without a finish reason")


def _params(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """The request's SamplingParams: given, or built from keyword overrides — not both."""
    if params is None:
        return SamplingParams(**overrides)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {type(params).__name__} "
                        "(or pass the fields as keywords: max_tokens=...)")
    if overrides:
        raise ValueError(f"pass either params or keyword fields, not both: {sorted(overrides)}")
    return params
