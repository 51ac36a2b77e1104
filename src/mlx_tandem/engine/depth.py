"""Depth policy: how many tokens to draft for each row this step.

`FixedDepth(k)`: k for every row (capped by the request's own limit and by the
tokens it may still generate).
`AdaptiveDepth(k_max)`: decides from measured goodput — tokens per second, not
acceptance alone. Rows whose drafts are deterministic share one depth k per step,
chosen to maximise

    sum over rows of E_i(k) / cost(k),   E_i(k) = 1 + o_i * ((1 - a_i^(k+1)) / (1 - a_i) - 1),

against k = 0 (plain decoding: every row emits one token at cost 1).
  * a_i: the row's acceptance (a accepted of d drafted, smoothed); o_i: the share of steps
    it was asked to draft in which its drafter proposed anything (prompt lookup finds
    no match on most chat rows). Both on the Request. A row not measured yet counts as
    the mean of the recent requests (each folded in once, when it leaves the cohort),
    and its own measurements start from that mean: every request is a new row, and an
    optimistic prior (or one lucky first draft) makes each chat row pay for drafts its
    kind of prompt never gets accepted. Per request, not per drafted step: the last
    rows of a burst are the ones drafting worst (they finish last), and counted per
    step they alone set where the next burst starts (on grounded prompts it started
    from 0.14 and drafted nothing for a quarter of the run).
  * cost(k), in plain steps of this batch-size bucket (vLLM's per-batch-size K): a
    verify runs its projections on real slots only (kv/attention.Ragged), so a step
    drafting k costs `1 + (f + c * x) / plain`, x = k * sum(o_i) / B the drafted tokens
    per row, with f (a drafted step's own cost) and c fitted apart from measured steps
    (DraftCost). The line is kept per number of projection calls the step needs
    (ceil(slots / quantum): each call streams the weights again, so a step's cost jumps
    where its slots cross a multiple of the runner's row quantum), and apart for verifies
    small enough to run turned (2-3 slots: models/invariance.SMALL_TURNED): a depth is
    priced by the measurements of the calls it needs.
    A measured step more than STALL times slower than its prediction is not learned from
    unless the one before it of its kind was slow too: a stall, not a change (Stalls).
The first drafted step drafts one token, so costs start from a measurement, not from
zero; a bucket whose drafted steps are not measured yet prices them as the nearest
measured bucket within a factor of two does (in plain steps) until it drafts, else it
measures the same way. Every RECALIBRATE steps (and the
first time a bucket is seen) all rows take a plain step, which measures that bucket's
plain step now; when drafting is off every
row probes depth 1 together, so estimates recover when drafting would pay again — first
PROBE steps apart, the interval doubling (up to PROBE_MAX) after each probe that did not
turn drafting on, back to PROBE once it does, and never closer than cost(1) /
PROBE_SHARE steps: at a large batch a probe costs nearly a whole extra step, and chat
that never drafts should not pay more than PROBE_SHARE (2%) of its time for it. A row
never asked to draft yet (a new request) is asked at the next step the PROBE_SHARE
spacing allows, however far the backed-off schedule is: a grounded request arriving
after a long chat load would otherwise finish before the next probe. A shared row's own
observations are averaged with its starting estimate weighted as PRIOR_WEIGHT of them
(then smoothed): one accepted probe moves it a third of the way, not all of it.

A drafter whose proposals cost host work only (prompt lookup's `propose`, set here as
`shadow` by the engine) measures rows drafting nothing instead: each takes the proposal it
would have drafted at k_max, unverified, and once the row has generated that many tokens
the proposal's matching prefix counts as its accepted drafts — exactly what verifying it
would have accepted (greedy rows emit the argmax, sampled rows each position's own keyed
sample, and a deterministic draft is accepted while it equals that). Estimates then stay
current while drafting is off, so no probes run: a grounded row whose first drafts failed
turns drafting on when it starts copying, and chat pays nothing to explore.

Rows whose drafts are stochastic (a drafter sampling a sampled row) keep a
row-local depth — their own acceptance and a fixed cost ratio, never the
engine's measurements or schedule — because their tokens depend on the depth
(the rejection rule's draws): a seeded row is then the same alone and batched.

Oracle: tests/test_speculative.py (adaptive depth is lossless; seeded stochastic
rows identical alone and batched), tests/test_depth.py (the decisions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import MAX_DRAFT

PROBE = 16
PROBE_MAX = 128
PROBE_SHARE = 0.02  # the most of a bucket's step time that probes may cost
RECALIBRATE = 32
PRIOR_WEIGHT = 2  # observations a shared row's starting estimate counts as
LEFT_WEIGHT = 0.125  # a finished request's weight in the new-row estimates (~the last 8)
ROW_LOCAL_COST = 0.1  # cost of one drafted token relative to a plain step, when not measured
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
STALL = 1.75  # a step this many times slower than predicted is a stall (unless the one before was)


def size_bucket(rows: int) -> int:
    """The batch-size bucket whose costs a step of `rows` rows uses."""
    return next((b for b in BUCKETS if rows <= b), BUCKETS[-1] * 2)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted by a row drafting k tokens with per-token acceptance alpha."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


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
        if not 0 <= k <= MAX_DRAFT:
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT}], got {k}")
        self.k = k

    def depths(self, requests: list[Request], stochastic: bool = False) -> list[int]:
        return [row_cap(r, self.k) for r in requests]

    def observe(self, *args: object) -> None:
        """A fixed depth learns nothing."""


class Stalls:
    """Tells an isolated stall from a change of speed. A step that takes more than STALL times
    its prediction (a garbage collection, the server's thread taking the interpreter, the
    machine's scheduler: ~1 step in 130 on this VM's server, 2-4x a plain one) is not learned
    from unless the step before it of the same kind was slow too. One 340 ms plain step among
    85 ms ones otherwise moved the plain cost to 136 ms, every drafted step then looked 40%
    cheaper than it was, and eight rows drafted for 40 steps at a loss (BENCHMARKS, session 30)."""

    def __init__(self) -> None:
        self.last_slow = False

    def isolated(self, seconds: float, predicted: float) -> bool:
        slow = seconds > STALL * predicted
        isolated, self.last_slow = slow and not self.last_slow, slow
        return isolated


class DraftCost:
    """A drafted step's extra seconds over a plain one as `fixed_s + per_token_s * x`, x the
    drafted tokens per row: a weighted least-squares line over recent drafted steps
    (exponentially decayed). Rows that propose nothing add no tokens, but a drafted step has
    costs of its own (the lookups, the wider attention block): fitted apart, a step where two
    rows of thirty-two propose does not make every drafted token look sixteen times dearer.
    While the steps seen all drafted about the same x, the line cannot be fitted and
    everything counts per token (the dearer reading)."""

    def __init__(self) -> None:
        self.per_token_s = 0.0  # extra seconds per drafted token on every row
        self.fixed_s = 0.0  # extra seconds of any drafted step
        self._sums = [0.0] * 5  # weight, x, x^2, extra, x * extra
        self.stalls = Stalls()

    def predict(self, x: float) -> float | None:
        """Extra seconds of a step drafting x tokens per row (None before any measurement)."""
        return self.fixed_s + self.per_token_s * x if self._sums[0] else None

    def add(self, x: float, extra: float, smoothing: float) -> None:
        keep = 1 - smoothing
        self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, x, x * x, extra, x * extra),
                                                   strict=True)]
        w, sx, sxx, se, sxe = self._sums
        mean_x, mean_e = sx / w, se / w
        var = sxx / w - mean_x * mean_x
        slope = (sxe / w - mean_x * mean_e) / var if var > 0.01 * mean_x * mean_x else -1.0
        fixed = mean_e - slope * mean_x
        if slope <= 0 or fixed < 0:  # not fittable yet: all of it per token
            slope, fixed = mean_e / mean_x, 0.0
        self.per_token_s, self.fixed_s = slope, fixed


class StepCosts:
    """Measured seconds for one batch-size bucket: a plain step (exponentially smoothed), and
    a DraftCost per number of projection calls a step takes (`pieces`: a verify of T real
    slots calls each projection ceil(T / quantum) times, each call streaming the weight
    again, so a step's cost jumps where T crosses a multiple of the quantum)."""

    def __init__(self) -> None:
        self.plain_s: float | None = None  # a verify with no drafts
        self.drafted: dict[int, DraftCost] = {}
        self.plain_stalls = Stalls()

    def fit(self, pieces: int) -> DraftCost | None:
        """The line for `pieces` calls, else the nearest measured (the fewer on a tie: an
        optimistic guess is tried once and then measured)."""
        if not self.drafted:
            return None
        return self.drafted[min(self.drafted, key=lambda p: (abs(p - pieces), p))]


class AdaptiveDepth:
    name = "adaptive"

    def __init__(
        self, k_max: int, prior: float = 0.6, smoothing: float = 0.2, quantum: int = 0,
        by_request: bool = True,
    ) -> None:
        if not 1 <= k_max <= MAX_DRAFT:  # a verify block wider than MAX_DRAFT + 1 would
            # overrun the sliding layers' rings (sized for it: ARCHITECTURE, state rows)
            raise ValueError(f"adaptive depth needs num_draft_tokens in [1, {MAX_DRAFT}], got {k_max}")
        self.k_max, self.prior, self.smoothing = k_max, prior, smoothing
        self.by_request = by_request  # False: the new-row estimates move per drafted step
        self._rows: dict[int, Request] = {}  # the last decision's shared rows (by id)
        self.quantum = quantum  # most rows one projection call takes (0: no limit); the engine
        # sets its runner's (ModelRunner.row_quantum)
        self.small = 0  # verifies of 2 .. this many slots run turned (ModelRunner.small_turned)
        # what a new shared row is assumed to do until it is measured: the recent requests' mean
        # (each request is a new row; a fixed optimistic prior makes every one pay to learn)
        self.seen_alpha, self.seen_offer = prior, 1.0
        self.costs: dict[int, StepCosts] = {}
        self.steps = 0
        self.probe_every = PROBE  # steps between probes while drafting is off
        self._next_probe = PROBE
        self._last_probe = 0
        self._asked: list[int] = []  # the depths of the step being decided (rows in order)
        self._local: set[int] = set()  # ids of its rows with a row-local depth
        # the drafter's proposals without a verify, for a drafter whose proposals cost only
        # host work (prompt lookup's `propose`): the engine sets it. Rows drafting
        # nothing are then measured by their shadows, and no probes run
        self.shadow: Callable[[list[Request], list[int]], list[list[int]]] | None = None

    def _alpha(self, r: Request) -> float:
        return r.spec_alpha if r.spec_alpha is not None else self.prior

    def shared_depth(
        self, alphas: list[float], c: float = 0.0, offers: list[float] | None = None,
        fixed: float = 0.0, cost: Callable[[int], float] | None = None,
    ) -> int:
        """The k in 0..k_max maximising the rows' expected tokens per unit of step time
        (`offers`: each row's share of steps its drafter proposes in; default always;
        `cost(k)`: a step drafting k, in plain steps; default 1 + fixed + k c (mean offer))."""
        offers = offers or [1.0] * len(alphas)
        drafting = sum(offers) / max(1, len(offers))  # rows that propose pay; the rest do not
        if cost is None:
            def cost(k: int) -> float:
                return 1 + fixed + k * c * drafting
        best, best_rate = 0, float(len(alphas))
        for k in range(1, self.k_max + 1):
            gains = (o * (expected_tokens(a, k) - 1) for a, o in zip(alphas, offers, strict=True))
            rate = (len(alphas) + sum(gains)) / cost(k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def depths(self, requests: list[Request], stochastic: bool = False) -> list[int]:
        self.steps += 1
        bucket = size_bucket(len(requests))
        costs = self.costs.setdefault(bucket, StepCosts())
        local = [stochastic and not r.params.greedy for r in requests]
        shared = [r for r, own in zip(requests, local, strict=True) if not own]
        if self.by_request:
            self._fold_left(shared)
        if self.shadow is not None:
            self._check_shadows(shared)
        priced = costs if costs.drafted else self._nearest_priced(bucket)
        if costs.plain_s is None or self.steps % RECALIBRATE == 0:
            k = 0  # a plain step: measures what a step of this size costs right now
        elif priced is None:
            k = 1  # one drafted token measures what drafting costs at all (not 0 s)
        else:
            alphas = [self.seen_alpha if r.spec_alpha is None else r.spec_alpha for r in shared]
            offers = [self.seen_offer if r.spec_offer is None else r.spec_offer for r in shared]
            cost = self._cost(priced, len(requests), sum(offers))
            k = self.shared_depth(alphas, offers=offers, cost=cost)
            if self.shadow is None:
                k = self._probe(k, cost(1) - 1, any(r.spec_offer is None for r in shared))
        out = []
        for r, own in zip(requests, local, strict=True):
            if own:
                mine = self.shared_depth([self._alpha(r)], ROW_LOCAL_COST)
                if mine == 0 and r.stats.generation_tokens % PROBE == PROBE - 1:
                    mine = 1
                out.append(row_cap(r, mine))
            else:
                out.append(row_cap(r, k))
        self._asked = out
        self._local = {id(r) for r, own in zip(requests, local, strict=True) if own}
        if self.shadow is not None:
            self._shadow_rows(requests, out)
        return out

    def _nearest_priced(self, bucket: int) -> StepCosts | None:
        """The bucket nearest in size (at most twice or half of it) whose drafted steps are
        priced, or None. A new bucket borrows its costs, in its plain steps, until one of
        its own steps drafts: forcing a drafted step in every new size (a burst of requests
        passes through eight as it fills and drains) made chat pay for drafts it was never
        going to keep. Farther sizes are another regime (one row streams the weights, 32
        rows are compute-bound): they are not borrowed from."""
        near = [b for b, c in self.costs.items() if c.drafted and bucket / 2 <= b <= 2 * bucket]
        return self.costs[min(near, key=lambda b: (abs(b - bucket), b))] if near else None

    def pieces(self, tokens: float) -> int:
        """Projection calls a verify of `tokens` real slots takes (1 without a quantum), and 0
        for a verify of 2 .. `small` slots: one call, turned, a cost line of its own (at one
        row, k = 1 and 2 cost about a plain step; k = 3 runs as it is, ~1.4x)."""
        if 2 <= tokens <= self.small:
            return 0
        return math.ceil(tokens / self.quantum) if self.quantum else 1

    def _cost(self, costs: StepCosts, rows: int, proposing: float) -> Callable[[int], float]:
        """A step drafting k, in plain steps: `proposing` rows (expected) add k slots each."""
        assert costs.plain_s is not None

        def cost(k: int) -> float:
            x = k * proposing / rows
            fit = costs.fit(self.pieces(rows + k * proposing))
            assert fit is not None
            return 1 + (fit.fixed_s + fit.per_token_s * x) / costs.plain_s

        return cost

    def _probe(self, k: int, c: float, fresh: bool = False) -> int:
        """k, or 1 when drafting is off and a probe is due (backing off while probes fail).
        A probe costs about c plain steps (one more token for every row), so probes are
        at least c / PROBE_SHARE steps apart: exploring never takes more than PROBE_SHARE
        of the time, however wide the batch. `fresh`: some row was never asked to draft;
        it is asked as soon as that spacing allows, without backing off further."""
        if k > 0:
            self.probe_every, self._next_probe = PROBE, self.steps + PROBE
            return k
        spacing = math.ceil(c / PROBE_SHARE)
        if fresh and self.steps >= self._last_probe + spacing:
            self._last_probe = self.steps
            self._next_probe = max(self._next_probe, self.steps + spacing)
            return 1
        if self.steps < self._next_probe:
            return 0
        self._last_probe = self.steps
        self._next_probe = self.steps + max(self.probe_every, spacing)
        self.probe_every = min(PROBE_MAX, 2 * self.probe_every)
        return 1

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
        asked = self._asked if len(self._asked) == len(requests) else [0] * len(requests)
        for r, d, a, k in zip(requests, drafted, accepted, asked, strict=True):
            if k:  # asked to draft: did its drafter propose anything?
                self._offered(r, d > 0)
            if d:
                self._learn(r, d, a)
        costs = self.costs.setdefault(size_bucket(len(requests)), StepCosts())
        if width == 1:
            if costs.plain_s is None:
                costs.plain_s = verify_s
            elif not costs.plain_stalls.isolated(verify_s, costs.plain_s):
                costs.plain_s = (1 - s) * costs.plain_s + s * verify_s
        elif costs.plain_s is not None and sum(drafted):  # the verify runs only real slots'
            # projections (kv/attention.Ragged), so its cost follows the drafted tokens
            x = sum(drafted) / len(requests)
            fit = costs.drafted.setdefault(self.pieces(len(requests) + sum(drafted)), DraftCost())
            predicted = fit.predict(x)
            if predicted is None or not fit.stalls.isolated(
                    draft_s + verify_s, costs.plain_s + predicted):
                fit.add(x, draft_s + max(0.0, verify_s - costs.plain_s), s)

    def _offered(self, r: Request, got: bool) -> None:
        """Row r was asked to draft (or shadowed) and its drafter proposed (got) or not."""
        s, x = self.smoothing, 1.0 if got else 0.0
        r.spec_offer = x if r.spec_offer is None else (1 - s) * r.spec_offer + s * x
        if not self.by_request:
            self.seen_offer = (1 - s) * self.seen_offer + s * x

    def _learn(self, r: Request, d: int, a: int) -> None:
        """Row r's drafts of d tokens had their first a accepted (verified, or shadowed).
        a / d: the drafts after a rejection count as failures, which reads acceptance low
        where it decays with position (prompt lookup on chat); a / (a + (a < d)) drafted
        more on chat and cost it (docs/BENCHMARKS.md, session 7). A shared row's first
        drafts say little: it starts from the recent rows' mean (a row-local one from its
        own first rate: its history)."""
        s, rate, local = self.smoothing, a / d, id(r) in self._local
        known = r.spec_alpha
        if known is None:
            known = rate if local else self.seen_alpha
        w = s if local else max(s, 1 / (PRIOR_WEIGHT + r.spec_seen + 1))
        r.spec_alpha = (1 - w) * known + w * rate
        r.spec_seen += 1
        if not self.by_request:
            self.seen_alpha = (1 - s) * self.seen_alpha + s * rate

    def _shadow_rows(self, requests: list[Request], depths: list[int]) -> None:
        """Shared rows drafting nothing this step take the drafter's proposal of k_max
        tokens, unverified (`shadow`: host work only); `_check_shadows` later compares it
        with the tokens the row generated — exactly what verifying it would have accepted
        (greedy rows emit the argmax; sampled rows each position's own keyed sample, and a
        deterministic draft is accepted while it equals that). One pending per row."""
        assert self.shadow is not None
        idle = [(r, cap) for r, k in zip(requests, depths, strict=True)
                if k == 0 and r.spec_shadow is None and id(r) not in self._local
                and (cap := row_cap(r, self.k_max)) > 0]
        if not idle:
            return
        proposals = self.shadow([r for r, _ in idle], [cap for _, cap in idle])
        for (r, _), proposal in zip(idle, proposals, strict=True):
            self._offered(r, bool(proposal))
            if proposal:
                r.spec_shadow = (len(r.tokens), proposal)

    def _check_shadows(self, requests: list[Request]) -> None:
        for r in requests:
            if r.spec_shadow is None:
                continue
            start, proposal = r.spec_shadow
            made = r.tokens[start : start + len(proposal)]
            if len(made) < len(proposal):
                continue  # not generated yet
            r.spec_shadow = None
            self._learn(r, len(proposal), next(
                (j for j, (p, t) in enumerate(zip(proposal, made, strict=True)) if p != t),
                len(proposal)))

    def _fold_left(self, shared: list[Request]) -> None:
        """Shared rows that left the cohort since the last decision each move the new-row estimates
        (`seen_alpha`, `seen_offer`) by LEFT_WEIGHT toward their own final ones: the mean of
        recent *requests*, each counted once. Counted per drafted step instead, the slowest
        rows of a burst (the ones drafting least well, so the last to finish) set the
        estimate every new row then starts from."""
        now = {id(r): r for r in shared}
        w = LEFT_WEIGHT
        for r in (r for key, r in self._rows.items() if key not in now):
            if r.spec_alpha is not None:
                self.seen_alpha = (1 - w) * self.seen_alpha + w * r.spec_alpha
            if r.spec_offer is not None:
                self.seen_offer = (1 - w) * self.seen_offer + w * r.spec_offer
        self._rows = now
