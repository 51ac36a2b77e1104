"""The drafter's per-row sampler (the seed's `DraftRowSampling`), shared by model drafters.

Oracle: tests/test_speculative.py (chi-square with sampled drafts; seeded rows alone == batched).
"""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx
import numpy as np

from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import PURPOSE_DRAFT, keyed_picks, position_keys, softmax_weights


class DraftRowSampling:
    """The drafter's per-row sampler (the seed's `DraftRowSampling`).

    Greedy rows draft the argmax. Sampled rows draw from the draft logits through the
    row's own truncation filters and temperature, keyed by (seed, absolute position,
    PURPOSE_DRAFT), so a row's drafts never depend on batch composition; their q is
    returned for the rejection rule. Rows sharing sampling settings share the ops.
    """

    def sample(
        self, requests: list[Request], logits: mx.array, step: int
    ) -> tuple[mx.array, list[mx.array | None]]:
        """logits (B, V) for draft step `step` -> tokens (B,), q per row ((1, V) or None)."""
        # sampling is shift-invariant (RowSampler.sample_logits): no log-softmax over V
        centered = logits - mx.max(logits, axis=-1, keepdims=True)
        tokens = list(mx.argmax(logits, axis=-1))
        qs: list[mx.array | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            if not r.sampler.params.greedy:
                groups[r.sampler.filter_key].append(i)
        for idx in groups.values():
            rows = [requests[i] for i in idx]
            sl = rows[0].sampler.sample_logits(centered[mx.array(idx, dtype=mx.int32)])
            positions = np.array([[r.position + step] for r in rows])
            keys = position_keys([r.sampler.seed for r in rows], positions, PURPOSE_DRAFT)
            weights = softmax_weights(sl)  # q, unnormalised: the draws follow it exactly
            draws = keyed_picks(keys[:, 0], weights)
            q = weights / weights.sum(axis=-1, keepdims=True)
            for n, i in enumerate(idx):
                tokens[i] = draws[n]
                qs[i] = q[n : n + 1]
        return mx.stack(tokens), qs
