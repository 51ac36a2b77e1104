"""Prompt lookup first, a model drafter elsewhere (`--draft-model assistant+ngram`).

Each step, a row whose last tokens recur earlier in its own text (a match of at
least `min_match` tokens) takes prompt lookup's proposal; every other row takes
the inner drafter's. Chat answers repeat themselves (lists, code, restated
names) where a small drafter guesses worst, and a long match is right more
often than the drafter's own guess there (docs/BENCHMARKS.md, session 23).

Only an inner drafter that keeps no state of its own proposals (`stateless`:
the assistant) can be combined: its rows may be fed tokens it did not propose.
Which source a row drafts from depends on the row's own tokens alone, so a row's
proposals never depend on its neighbours; lookup's proposals are deterministic
(q None), so a seeded row under a greedy inner drafter is token-identical to
plain sampling with that seed.

Oracle: tests/test_lookup_first.py (greedy and seeded sampled output == plain,
rows joining and leaving — deterministic drafts handed over as one-hot q break
the latter; a row with a match drafts lookup's tokens, one without the inner
drafter's; the chi-square test in sampled mode).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.draft_source import Drafts, DraftSource
from mlx_tandem.engine.request import Request
from mlx_tandem.kv.state_rows import PreparedChange, StateRows

MIN_MATCH = 2  # a single recurring token predicts its successor worse than the assistant


class LookupFirstSource:
    stateless = True

    def __init__(self, inner: DraftSource, min_match: int = MIN_MATCH, max_match: int = 3) -> None:
        if not inner.stateless:
            raise ValueError(
                f"'{inner.name}+ngram': the {inner.name} drafter keeps state of its own "
                "proposals, so prompt lookup cannot draft for its rows (use 'assistant+ngram')"
            )
        self.inner = inner
        self.lookup = PromptLookupSource(min_match, max_match)
        self.name = f"{inner.name}+ngram"
        self.samples = inner.samples

    def prepare_append(self, requests: list[Request], hidden: mx.array) -> PreparedChange:
        return self.inner.prepare_append(requests, hidden)

    def filter_rows(self, keep: list[int]) -> None:
        self.inner.filter_rows(keep)

    def commit(self, accepted: list[int], hidden: mx.array) -> None:
        self.inner.commit(accepted, hidden)

    def draft(self, requests: list[Request], depths: list[int], target: StateRows) -> Drafts:
        found = self.lookup.propose(requests, depths)
        rest = [0 if tokens else k for tokens, k in zip(found, depths, strict=True)]
        inner = self.inner.draft(requests, rest, target)
        return Drafts(
            tokens=[f or d for f, d in zip(found, inner.tokens, strict=True)],
            q=[None if f else q for f, q in zip(found, inner.q, strict=True)],
        )
