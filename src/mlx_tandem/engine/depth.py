"""Depth policy: how many tokens to draft for each row this step.

`FixedDepth(k)`: k for every row (capped by the request's own limit and by the
tokens it may still generate).
`AdaptiveDepth(k_max)`: keeps a per-row acceptance estimate alpha (on the
Request) and measured step costs, and picks the k in 0..k_max that maximises
expected tokens per unit time,
    E(k) = (1 - alpha^(k+1)) / (1 - alpha),   cost(k) = 1 + k * c,
where c is the measured cost of one more drafted-and-verified token relative
to a plain step. A row at depth 0 is probed with depth 1 every PROBE steps so
its estimate can recover; every RECALIBRATE steps (and first) all rows take
a plain step, which measures the current cost of a step without drafts.

Oracle: tests/test_speculative.py (adaptive depth is lossless).
"""

from __future__ import annotations

from typing import Protocol

from mlx_tandem.engine.request import Request

PROBE = 8
RECALIBRATE = 32
ROW_LOCAL_COST = 0.1  # cost of one drafted token relative to a plain step, when not measured


class DepthPolicy(Protocol):
    name: str

    def depths(self, requests: list[Request], stochastic: bool = False) -> list[int]:
        """Tokens to draft for each row this step (`stochastic`: the drafter samples
        sampled rows, so their depth must depend on their own history only)."""
        ...

    def observe(
        self,
        requests: list[Request],
        drafted: list[int],
        accepted: list[int],
        draft_s: float,
        verify_s: float,
        width: int,
    ) -> None:
        """Learn from a finished step: per-row drafted/accepted, seconds, verify width."""
        ...


def row_cap(request: Request, k: int) -> int:
    cap = request.params.num_draft_tokens
    k = k if cap is None else min(k, cap)
    return max(0, min(k, request.params.max_tokens - len(request.tokens) - 1))


class FixedDepth:
    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k}")
        self.k = k

    def depths(self, requests: list[Request], stochastic: bool = False) -> list[int]:
        return [row_cap(r, self.k) for r in requests]

    def observe(self, *args: object) -> None:
        """A fixed depth learns nothing."""


class AdaptiveDepth:
    name = "adaptive"

    def __init__(self, k_max: int, prior: float = 0.6, smoothing: float = 0.2) -> None:
        if k_max < 1:
            raise ValueError(f"adaptive depth needs num_draft_tokens >= 1, got {k_max}")
        self.k_max, self.prior, self.smoothing = k_max, prior, smoothing
        self.plain_s: float | None = None  # seconds of a verify with no drafts
        self.per_token_s = 0.0  # extra seconds per drafted token (draft + verify)
        self.steps = 0

    def _best(self, alpha: float, c: float) -> int:
        best, best_rate = 0, 1.0
        for k in range(1, self.k_max + 1):
            expected = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
            rate = expected / (1 + k * c)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def depths(self, requests: list[Request], stochastic: bool = False) -> list[int]:
        self.steps += 1
        measured = self.per_token_s / self.plain_s if self.plain_s else ROW_LOCAL_COST
        recalibrate = self.plain_s is None or self.steps % RECALIBRATE == 0
        out = []
        for r in requests:
            row_local = stochastic and not r.params.greedy
            if recalibrate and not row_local:
                out.append(0)  # a plain step: measures what a step costs right now
                continue
            alpha = r.spec_alpha if r.spec_alpha is not None else self.prior
            k = self._best(alpha, ROW_LOCAL_COST if row_local else measured)
            if k == 0 and r.stats.generation_tokens % PROBE == PROBE - 1:
                k = 1
            out.append(row_cap(r, k))
        return out

    def observe(
        self,
        requests: list[Request],
        drafted: list[int],
        accepted: list[int],
        draft_s: float,
        verify_s: float,
        width: int,
    ) -> None:
        s = self.smoothing
        for r, d, a in zip(requests, drafted, accepted, strict=True):
            if d:
                rate = a / d
                r.spec_alpha = rate if r.spec_alpha is None else (1 - s) * r.spec_alpha + s * rate
        if width == 1:
            self.plain_s = (
                verify_s if self.plain_s is None else (1 - s) * self.plain_s + s * verify_s
            )
        elif self.plain_s is not None:
            extra = (draft_s + max(0.0, verify_s - self.plain_s)) / (width - 1)
            self.per_token_s = (1 - s) * self.per_token_s + s * extra
