"""The draft-source contract (the seed's `spec/source`) every drafter implements.

A drafter keeps whatever per-row state it needs in the cohort's row order and
follows the cohort's membership: rows join (`prepare_append` -> commit) and
leave (`filter_rows`) exactly when the target's rows do. Each step it proposes
up to `depths[i]` tokens for row i (zero allowed); after verification it learns
how many each row accepted (`commit`).

`Drafts.q` carries the distribution each proposal was drawn from when the
drafter samples (None: proposals are deterministic, q is one-hot) — the
verifier needs it for the rejection rule.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import PURPOSE_DRAFT, position_keys
from mlx_tandem.kv.state_rows import PreparedChange


@dataclass
class Drafts:
    tokens: list[list[int]]  # per row, len <= that row's depth
    q: list[mx.array | None]  # per row: (len, V) probabilities the tokens were drawn from


class DraftSource(Protocol):
    name: str

    def prepare_append(self, requests: list[Request]) -> PreparedChange:
        """Make room for joining rows (e.g. prefill their prompts); inert until commit."""
        ...

    def filter_rows(self, keep: list[int]) -> None: ...

    def draft(self, requests: list[Request], depths: list[int]) -> Drafts: ...

    def commit(self, accepted: list[int]) -> None:
        """Row i accepted its first accepted[i] proposals (the target emitted one more)."""
        ...

    def release(self) -> None: ...


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
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = list(mx.argmax(lp, axis=-1))
        qs: list[mx.array | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            if not r.sampler.params.greedy:
                groups[r.sampler.filter_key].append(i)
        for idx in groups.values():
            rows = [requests[i] for i in idx]
            sl = rows[0].sampler.sample_logits(lp[mx.array(idx, dtype=mx.int32)])
            positions = np.array([[r.position + step] for r in rows])
            keys = position_keys([r.sampler.seed for r in rows], positions, PURPOSE_DRAFT)
            draws = mx.vmap(lambda k, x: mx.random.categorical(x, key=k))(keys[:, 0], sl)
            q = mx.softmax(sl.astype(mx.float32), axis=-1)
            for n, i in enumerate(idx):
                tokens[i] = draws[n]
                qs[i] = q[n : n + 1]
        return mx.stack(tokens), qs
