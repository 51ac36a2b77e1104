"""Prompt-lookup drafting: propose what followed the last earlier occurrence of the row's suffix.

For n from n_max down to n_min, the row's last n tokens (prompt + output) are
searched among its earlier tokens: one vectorised comparison over the row finds
where its last token occurred before, and each longer suffix keeps those of them
preceded by its next token back; the most recent match of the longest suffix wins
and the up to k tokens that followed it are proposed. No match: zero proposals. Proposals are
deterministic (q is one-hot). The drafter is stateless beyond each request's
own token list, so membership changes need no work.

Oracle: tests/test_speculative.py (the latest longest match; greedy and seeded
sampled output == plain decoding).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_tandem.engine.draft_source import Drafts
from mlx_tandem.engine.request import Request
from mlx_tandem.kv.state_rows import PreparedChange, StateRows


def lookup(tokens: np.ndarray, k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix."""
    size = len(tokens)
    if k <= 0 or size < 2:
        return []
    # every earlier occurrence of a suffix ends where the last token occurred before: one
    # comparison over the row finds those places, each longer suffix keeps some of them
    ends = np.flatnonzero(tokens[: size - 1] == tokens[-1])
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        hits = ends[ends >= n - 1]  # the occurrence starts at or after 0
        for back in range(1, n):
            hits = hits[tokens[hits - back] == tokens[size - 1 - back]]
        if hits.size:
            start = int(hits[-1]) + 1
            return tokens[start : start + k].tolist()
    return []


class PromptLookupSource:
    name = "ngram"
    samples = False
    stateless = True

    def __init__(self, n_min: int = 1, n_max: int = 3) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max

    def prepare_append(self, requests: list[Request], hidden: mx.array) -> PreparedChange:
        return PreparedChange(lambda: None, lambda: None)

    def filter_rows(self, keep: list[int]) -> None:
        pass

    def propose(self, requests: list[Request], depths: list[int]) -> list[list[int]]:
        """Up to depths[i] tokens for row i, from its tokens alone (no state changes): also
        what adaptive depth checks against the tokens rows generate while drafting nothing."""
        return [
            lookup(np.asarray(r.prompt + r.tokens, dtype=np.int64), k, self.n_min, self.n_max)
            if k > 0
            else []
            for r, k in zip(requests, depths, strict=True)
        ]

    def draft(self, requests: list[Request], depths: list[int], target: StateRows) -> Drafts:
        return Drafts(tokens=self.propose(requests, depths), q=[None] * len(requests))

    def commit(self, accepted: list[int], hidden: mx.array) -> None:
        pass
