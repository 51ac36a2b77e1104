"""Lossless verification of each row's proposals against the target's logits.

For row r with proposals d_1..d_k and target logits at slots 0..k (slot j sees
pending, d_1..d_j), the target distribution p_j is built by the row's own
RowSampler exactly as plain decoding builds it (processors on a history that
includes d_1..d_j, then truncation filters and temperature).

  * greedy: accept d_{j+1} while it equals argmax p_j; emit the argmax at the
    first mismatch (or the bonus argmax p_k after a full accept);
  * sampled, deterministic drafts (prompt lookup, greedy drafting; q is None):
    draw the position's own keyed sample t_j ~ p_j (the draw plain sampling
    makes there), accept d_{j+1} while t_j == d_{j+1}, emit t_j at the first
    mismatch, t_k after a full accept. Acceptance probability p_j(d) and the
    rejected slot's distribution are exactly the rejection rule's for a one-hot
    q, and the tokens are exactly plain sampling's with the same seed, so a
    seeded row's text never depends on how deep it drafted;
  * sampled, stochastic drafts (Leviathan et al. / Chen et al.): accept d_{j+1}
    when u * q_j(d_{j+1}) <= p_j(d_{j+1}), u ~ U(0,1); on rejection draw from
    normalize(max(0, p_j - q_j)); after a full accept draw the bonus from p_k.
    Ratios in float32.
Greedy rows without processors never need the log-softmax (a pass of `exp` over
the vocabulary per slot, the largest cost of a batched step's verify on a CPU):
their pick is the argmax of the raw logits, which is the argmax of the logprobs
unless another logit lies within TIE_MARGIN of the top one (`_greedy_picks`). When
every row is such a row and reports no logprobs (`certifiable`), the engine may hand
over picks certified from one fast head call (models/certified_head.py) instead: then
only their unsure slots' rows get exact logits, in one call of their own.
Randomness is keyed by (seed, absolute position, purpose), so a row's outcome
never depends on the batch, and a row with no proposals draws exactly the
token plain decoding draws. All rows are decided with batched ops (rows that
share sampling settings share the filter ops) and one host read.

Oracle: tests/test_speculative.py (greedy token-identical to plain decoding;
chi-square on the joint distribution of sampled tokens, which also rejects a
deliberately wrong `accept_draft`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import (
    PURPOSE_ACCEPT,
    PURPOSE_SAMPLE,
    keyed_draws,
    keyed_picks,
    position_keys,
)


@dataclass
class Verdict:
    accepted: int  # proposals accepted
    tokens: list[int]  # accepted proposals + the target's token
    logprobs: list[mx.array]  # per emitted token, its slot's processed logprobs (1, V)


@dataclass
class CertifiedPicks:
    """Greedy picks (B, S) from a fast head call, `unsure` where they need the exact logits;
    `rows_logits(rows)`: those rows' exact logits (n, S, V), computed in a call of their
    own (a row's logits never depend on its call: models/invariance.py)."""

    picks: mx.array
    unsure: mx.array
    rows_logits: Callable[[list[int]], mx.array]


# x - lse rounds monotonically in x, so the raw argmax is never beaten, only tied: two logits
# whose logprobs round to one value differ by less than one ulp of a logprob in [-log V, 0],
# at most 2^-20 for any vocabulary under 2^23 tokens. A slot with a rival within this margin
# takes the argmax of its logprobs.
TIE_MARGIN = 2.0**-16


def accept_draft(u: mx.array, p_d: mx.array, q_d: mx.array) -> mx.array:
    """The rejection rule: accept d with probability min(1, p(d) / q(d)), as u * q(d) <= p(d)."""
    return u * q_d <= p_d


def slot_logprobs(requests: list[Request], logits: mx.array, drafts: list[list[int]]) -> mx.array:
    """Processed logprobs (B, S, V): log-softmax, after each row's processors where it has any."""
    out = _logprobs(logits)
    special = [i for i, r in enumerate(requests) if _processed(r)]
    if not special:
        return out
    rows = [out[i] for i in range(len(requests))]
    for i in special:
        r, history, slots = requests[i], requests[i].history, []
        for j in range(logits.shape[1]):
            if j > 0:
                step = drafts[i][j - 1 : j] or [0]  # slots past the row's drafts are padding
                history = mx.concatenate([history, mx.array(step, dtype=mx.uint32)])
            slots.append(r.sampler.logprobs(logits[i, j : j + 1], history))
        rows[i] = mx.concatenate(slots)
    return mx.stack(rows)


def _greedy_picks(
    requests: list[Request], logits: mx.array, lp: mx.array
) -> tuple[mx.array, mx.array]:
    """Each greedy slot's candidate argmax (B, S) and whether it is unsure (B, S): greedy
    rows with processors take their logprobs' argmax; other greedy rows the raw logits'
    argmax, unsure where a rival logit lies within TIE_MARGIN of it (`_settled`). Sampled
    rows' entries are never read (never unsure)."""
    greedy = [r.sampler.params.greedy for r in requests]
    processed = [g and _processed(r) for g, r in zip(greedy, requests, strict=True)]
    raw = mx.argmax(logits, axis=-1)
    top = mx.take_along_axis(logits, raw[..., None], axis=-1)
    unsure = ((logits >= top - TIE_MARGIN).sum(axis=-1) > 1) | ~mx.isfinite(top[..., 0])
    plain = mx.array([g and not p for g, p in zip(greedy, processed, strict=True)])[:, None]
    if not any(processed):
        return raw, unsure & plain
    picks = mx.stack([mx.argmax(lp[i], axis=-1) if p else raw[i] for i, p in enumerate(processed)])
    return picks, unsure & plain


def _settled(
    picks: list[list[int]], unsure: list[list[bool]], lp: mx.array,
    certified: CertifiedPicks | None,
) -> list[list[int]]:
    """The unsure slots (rare) decided on their rows' logprobs (argmax lp is the exact pick:
    it differs from the raw logits' argmax only on a tie within TIE_MARGIN, where lp decides):
    the verify's own, or with certified picks, their rows' exact logits computed apart."""
    rows = [i for i, flags in enumerate(unsure) if any(flags)]
    if not rows:
        return picks
    exact = lp[mx.array(rows)] if certified is None else _logprobs(certified.rows_logits(rows))
    for i, row in zip(rows, mx.argmax(exact, axis=-1).tolist(), strict=True):
        picks[i] = [e if f else p for p, e, f in zip(picks[i], row, unsure[i], strict=True)]
    return picks


def _processed(r: Request) -> bool:
    return r.sampler.needs_history and r.history is not None


def certifiable(requests: list[Request]) -> bool:
    """Whether every row needs only the argmax of its logits: greedy, no processors, no
    logprobs reported (grammar masks are the caller's to rule out)."""
    return all(
        r.sampler.params.greedy and not _processed(r) and not r.params.logprobs
        for r in requests
    )


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _sample_scores(requests: list[Request], logits: mx.array, lp: mx.array) -> mx.array:
    """What sampled rows draw from, each row up to a constant (RowSampler.sample_logits):
    rows with processors their logprobs, others their logits minus the max — sampling needs
    no log-softmax, whose pass of `exp` over the vocabulary cost more than the draw."""
    centered = logits - mx.max(logits, axis=-1, keepdims=True)
    if not any(_processed(r) for r in requests):
        return centered
    return mx.stack([lp[i] if _processed(r) else centered[i] for i, r in enumerate(requests)])


def _sampled(
    requests: list[Request], scores: mx.array, drafts: list[list[int]], q: list[mx.array | None]
) -> tuple[mx.array, mx.array, mx.array]:
    """For sampled rows: acceptance flags (n, K), residual draws (n, K), bonus draws (n, S)."""
    n, S, V = scores.shape
    K = S - 1
    logits = requests[0].sampler.sample_logits(scores)  # same filter_key for the whole group
    positions = np.array([[r.position + j for j in range(S)] for r in requests])
    seeds = [r.sampler.seed for r in requests]
    sample_keys = position_keys(seeds, positions, PURPOSE_SAMPLE)
    bonus = keyed_draws(sample_keys.reshape(-1, 2), logits.reshape(-1, V)).reshape(n, S)
    if K == 0:
        return mx.zeros((n, 0), mx.bool_), mx.zeros((n, 0), mx.uint32), bonus
    d = mx.array([dr + [0] * (K - len(dr)) for dr in drafts], dtype=mx.int32)  # (n, K)
    # Deterministic drafts: accept while the position's own keyed sample equals the draft, and
    # emit that sample at the first mismatch — the same token plain sampling draws there.
    own = bonus[:, :K].astype(mx.int32)
    if all(qi is None for qi in q):  # prompt lookup: no rejection rule to evaluate
        return own == d, own, bonus
    one_hot = (mx.arange(V)[None, None] == d[..., None]).astype(mx.float32)
    q_full = mx.stack(
        [
            one_hot[i]
            if qi is None
            else mx.concatenate([qi.astype(mx.float32), one_hot[i, qi.shape[0] :]])
            for i, qi in enumerate(q)
        ]
    )
    p = mx.softmax(logits.astype(mx.float32), axis=-1)[:, :K]
    p_d = mx.take_along_axis(p, d[..., None], axis=-1)[..., 0]
    q_d = mx.take_along_axis(q_full, d[..., None], axis=-1)[..., 0]
    u = mx.vmap(lambda k: mx.random.uniform(shape=(), key=k))(
        position_keys(seeds, positions[:, :K], PURPOSE_ACCEPT).reshape(-1, 2)
    ).reshape(n, K)
    residual = mx.maximum(p - q_full, 0.0)
    empty = residual.sum(axis=-1, keepdims=True) <= 0  # p == q: the draw is never used
    residual = mx.where(empty, p, residual)
    draws = keyed_picks(sample_keys[:, :K].reshape(-1, 2), residual.reshape(-1, V)).reshape(n, K)
    fixed = mx.array([qi is None for qi in q])[:, None]
    accept = mx.where(fixed, own == d, accept_draft(u, p_d, q_d))
    draws = mx.where(fixed, own, draws.astype(mx.int32))
    return accept, draws, bonus


def verify(
    requests: list[Request],
    logits: mx.array,
    drafts: list[list[int]],
    q: list[mx.array | None],
    allowed: mx.array | None = None,
    certified: CertifiedPicks | None = None,
) -> list[Verdict]:
    """logits (B, K+1, V) from one target forward over [pending, drafts...] per row;
    allowed (B, K+1, V) bool: the grammar masks of constrained rows (engine/constraint.py),
    applied before anything else, exactly as plain constrained decoding applies them;
    certified: picks for rows that are all `certifiable` (then `logits` stays unevaluated
    unless something reads the Verdicts' logprobs)."""
    assert certified is None or (allowed is None and certifiable(requests))
    if allowed is not None:
        logits = mx.where(allowed, logits, -mx.inf)
    lp = slot_logprobs(requests, logits, drafts)  # lazy: greedy rows may never need it
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        if not r.sampler.params.greedy:
            groups[r.sampler.filter_key].append(i)
    decided = {}
    scores = _sample_scores(requests, logits, lp) if groups else None  # lazy, as lp
    for idx in groups.values():  # one group of every row (the usual case) needs no gather
        rows = scores if len(idx) == len(requests) else scores[mx.array(idx, dtype=mx.int32)]
        decided[tuple(idx)] = _sampled(
            [requests[i] for i in idx], rows, [drafts[i] for i in idx], [q[i] for i in idx]
        )
    if sum(map(len, groups.values())) == len(requests):  # every row sampled: no greedy picks
        picks = mx.zeros(logits.shape[:2], mx.uint32)
        unsure = mx.zeros(logits.shape[:2], mx.bool_)
    elif certified is None:
        picks, unsure = _greedy_picks(requests, logits, lp)
    else:
        picks, unsure = certified.picks, certified.unsure
    mx.eval(picks, unsure, *(x for arrays in decided.values() for x in arrays))  # one host sync
    host_argmax = _settled(picks.tolist(), unsure.tolist(), lp, certified)
    per_row: dict[int, tuple[list[bool], list[int], list[int]]] = {}
    for idx, (accept, draws, bonus) in decided.items():
        a, dr, bo = accept.tolist(), draws.tolist(), bonus.tolist()
        for n, i in enumerate(idx):
            per_row[i] = (a[n], dr[n], bo[n])
    verdicts = []
    for i, d in enumerate(drafts):
        if i in per_row:
            flags, draws, bonus = per_row[i]
            a = next((j for j in range(len(d)) if not flags[j]), len(d))
            last = draws[a] if a < len(d) else bonus[a]
        else:
            picks = host_argmax[i]
            a = next((j for j, tok in enumerate(d) if picks[j] != tok), len(d))
            last = picks[a]
        verdicts.append(Verdict(a, [*d[:a], last], [lp[i, j : j + 1] for j in range(a + 1)]))
    return verdicts
