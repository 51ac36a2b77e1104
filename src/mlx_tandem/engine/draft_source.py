"""The draft-source contract (the seed's `spec/source`) every drafter implements.

A drafter keeps whatever per-row state it needs in the cohort's row order and
follows the cohort's membership: rows join (`prepare_append` -> commit) and
leave (`filter_rows`) exactly when the target's rows do. Each step it proposes
up to `depths[i]` tokens for row i (zero allowed), and may read the target's
rows (their committed K/V: the assistant drafter's donors); after verification
it learns how many each row accepted (`commit`).

The engine hands every drafter the target's final hidden state at the last
position each row fed — the last prefilled prompt token on joining, the last
accepted verify slot after each step — computed by forwards it runs anyway.
Drafters that do not read it never evaluate it (MLX is lazy).

A drafter whose rows need the prompt (a draft model) may also offer
`prefill(request, upto)`: the engine calls it after each chunk of a long
prompt's prefill, so that work runs inside the same budgeted prefill units;
`prepare_append` then does only what is left.

A drafter whose proposals cost host work only (prompt lookup) may also offer
`propose(requests, depths) -> list[list[int]]`: the tokens `draft` would propose, with no
state change. Adaptive depth then measures rows that draft nothing by checking those
proposals against the tokens the rows go on to generate (engine/depth.py), instead of
probing with real drafts.

`Drafts.q` carries the distribution each proposal was drawn from when the
drafter samples (None: proposals are deterministic, q is one-hot) — the
verifier needs it for the rejection rule.

Oracle: tests/test_speculative.py (every drafter through this port is lossless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlx_tandem.engine.request import Request
from mlx_tandem.kv.state_rows import PreparedChange, StateRows


@dataclass
class Drafts:
    tokens: list[list[int]]  # per row, len <= that row's depth
    q: list[mx.array | None]  # per row: (len, V) probabilities the tokens were drawn from


class DraftSource(Protocol):
    name: str
    samples: bool  # whether sampled rows get stochastic drafts (q given), not deterministic ones
    stateless: bool  # keeps no state of its own proposals: the engine may propose others

    def prepare_append(self, requests: list[Request], hidden: mx.array) -> PreparedChange:
        """Make room for joining rows (e.g. prefill their prompts); inert until commit.
        hidden (n, D): the target's final hidden at each row's last prefilled token."""
        ...

    def filter_rows(self, keep: list[int]) -> None: ...

    def draft(self, requests: list[Request], depths: list[int], target: StateRows) -> Drafts:
        """Proposals per row; `target` is the target's rows at their committed ends (read-only)."""
        ...

    def commit(self, accepted: list[int], hidden: mx.array) -> None:
        """Row i accepted its first accepted[i] proposals (the target emitted one more);
        hidden (B, D): the target's final hidden at each row's last accepted slot."""
        ...
