"""Top-p (nucleus) truncation without sorting the whole vocabulary.

mlx-lm's `apply_top_p` sorts every row's V log-probabilities to find the threshold (the
least log-probability kept): 3.2 ms a row for SmolLM2's 49,152 here, 52 ms for a
16-row step (docs/BENCHMARKS.md, session 31). The kept tokens are the nucleus, and a
nucleus is nearly always a few hundred tokens: the row's top CANDIDATES are selected
(`mx.topk`, a partition: ~0.3 ms a row) and only they are sorted. A token's mass-above
(the probability of the tokens ranked above it) sums the same tokens in the same order
whether the row or only its candidates were sorted, so the threshold is the full sort's
wherever the nucleus ends inside the candidates; where it does not (a flat distribution:
the least candidate is kept too), that row is sorted whole instead (one host read of
the flags per call). The rule is mlx-lm's — a token is dropped where its mass-above reaches
top_p of the row's total mass — with the total summed directly, its exp the rows
softmax's `pow2` (mlx-lm adds it up in sorted order, ~5e-5 apart on SmolLM2's rows), so a
token whose mass-above lies that close to the cut can be kept by one and dropped by the
other.

The filter is a function of the row alone, used by both plain sampling and speculative
verification (engine/sampling.RowSampler.sample_logits), so it changes no row's
alone == batched or plain == speculative guarantee.

Oracle: tests/test_top_p.py (candidates == the full sort, bit for bit, on peaked, flat
and tied rows; control: on flat rows the candidates alone keep too few tokens, so the
fallback is needed; the kept sets differ from mlx-lm's only at the cut).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.kv.attention import LOG2E, pow2

CANDIDATES = 1024  # tokens sorted per row; a nucleus wider than this sorts the whole rows


def top_p_filter(logprobs: mx.array, top_p: float, candidates: int = CANDIDATES) -> mx.array:
    """logprobs (..., V) with every token below its row's top-p threshold set to -inf. A row
    may be shifted by a constant that keeps its top at most 0 (logits minus their max):
    the rule compares masses with the row's own total."""
    width = logprobs.shape[-1]
    rows = logprobs.reshape(-1, width)
    threshold, fits = _threshold(rows, top_p, min(candidates, width))
    if candidates < width:
        wide = [i for i, ok in enumerate(fits[:, 0].tolist()) if not ok]
        if wide:  # nuclei wider than their candidates: those rows sorted whole
            at = mx.array(wide, dtype=mx.int32)
            threshold[at] = _threshold(rows[at], top_p, width)[0]
    return mx.where(rows < threshold, -float("inf"), rows).reshape(logprobs.shape)


def _threshold(logprobs: mx.array, top_p: float, candidates: int) -> tuple[mx.array, mx.array]:
    """Each row's least kept log-probability (n, 1) from its top `candidates`, and whether
    the nucleus ends inside them (n, 1): the least candidate is dropped."""
    top = logprobs if candidates == logprobs.shape[-1] else mx.topk(logprobs, candidates, -1)
    top = mx.sort(top, axis=-1)  # ascending
    probs = mx.exp(top.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = _total_mass(logprobs)
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    return mx.take_along_axis(top, dropped, axis=-1), dropped > 0


@mx.compile
def _total_mass(logprobs: mx.array) -> mx.array:
    """Each row's total probability (n, 1), exp as `pow2` (MLX's `exp` over all V is scalar
    here: 7.7 ms for 16 rows; a token below e^-87 adds 2^-126 instead of ~0)."""
    y = mx.maximum(logprobs.astype(mx.float32) * LOG2E, -126.0)
    return mx.sum(pow2(y), axis=-1, keepdims=True)

