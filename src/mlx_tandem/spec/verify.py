"""Lossless verification of each row's proposals against the target's logits.

For row r with proposals d_1..d_k and target logits at slots 0..k (slot j sees
pending, d_1..d_j), the target distribution p_j is built by the row's own
RowSampler exactly as plain decoding builds it (processors on a history that
includes d_1..d_j, then truncation filters and temperature).

  * greedy: accept d_{j+1} while it equals argmax p_j; emit the argmax at the
    first mismatch (or the bonus argmax p_k after a full accept);
  * sampled (Leviathan et al. / Chen et al.): accept d_{j+1} when
    u * q_j(d_{j+1}) <= p_j(d_{j+1}), u ~ U(0,1); on rejection draw from
    normalize(max(0, p_j - q_j)); after a full accept draw the bonus from p_k.
    q is one-hot for deterministic drafters. Ratios in float32.
Randomness is keyed by (seed, absolute position, purpose), so a row's outcome
never depends on the batch; a row with no proposals draws exactly the token
plain decoding draws.

Oracle: tests/test_speculative.py (greedy token-identical to plain decoding;
chi-square on the joint distribution of sampled tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_tandem.engine.request import Request
from mlx_tandem.engine.sampling import PURPOSE_ACCEPT, PURPOSE_SAMPLE, RowSampler, position_key


@dataclass
class Verdict:
    accepted: int  # proposals accepted
    tokens: list[int]  # accepted proposals + the target's token
    logprobs: list[mx.array]  # per emitted token, its slot's processed logprobs (1, V)


def slot_logprobs(
    sampler: RowSampler, logits: mx.array, history: mx.array | None, drafts: list[int]
) -> list[mx.array]:
    """Processed logprobs (1, V) at each slot 0..k, history growing by the drafts."""
    out = []
    for j in range(logits.shape[0]):
        if history is not None and j > 0:
            history = mx.concatenate([history, mx.array(drafts[j - 1 : j], dtype=mx.uint32)])
        out.append(sampler.logprobs(logits[j : j + 1], history))
    return out


@dataclass
class _Pending:
    """Device-side decisions for one row, read back together with every other row's."""

    greedy: bool
    picks: mx.array  # greedy: argmax per slot (k+1,); sampled: residual draws + bonus (k+1,)
    accept: mx.array | None  # sampled: acceptance flags (k,)


def _decide(
    request: Request, logprobs: list[mx.array], drafts: list[int], q: mx.array | None
) -> _Pending:
    sampler, base = request.sampler, request.position
    lp = mx.concatenate(logprobs, axis=0)  # (k+1, V)
    if sampler.params.greedy:
        return _Pending(True, mx.argmax(lp, axis=-1), None)
    k = len(drafts)
    logits = sampler.sample_logits(lp)  # (k+1, V): what plain sampling draws from
    keys = [position_key(sampler.seed, base + j) for j in range(k + 1)]
    if k == 0:
        return _Pending(False, mx.random.categorical(logits[0:1], key=keys[0]), None)
    p = mx.softmax(logits.astype(mx.float32), axis=-1)
    d = mx.array(drafts, dtype=mx.int32)
    p_d = mx.take_along_axis(p[:k], d[:, None], axis=-1)[:, 0]
    if q is None:  # deterministic drafter: q is one-hot at d
        q_d = mx.ones_like(p_d)
        residual = p[:k] * (mx.arange(p.shape[-1])[None] != d[:, None])
    else:
        q = q.astype(mx.float32)
        q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        residual = mx.maximum(p[:k] - q, 0.0)
    u = mx.stack(
        [
            mx.random.uniform(shape=(), key=position_key(sampler.seed, base + j, PURPOSE_ACCEPT))
            for j in range(k)
        ]
    )
    accept = u * q_d <= p_d
    # where p <= q everywhere (only if p == q) any residual draw is unused: fall back to p
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    residual = mx.where(empty, p[:k], residual)
    draws = [mx.random.categorical(mx.log(residual[j : j + 1]), key=keys[j]) for j in range(k)]
    bonus = mx.random.categorical(logits[k : k + 1], key=keys[k])
    return _Pending(False, mx.concatenate([*draws, bonus]), accept)


def verify(
    requests: list[Request], logits: mx.array, drafts: list[list[int]], q: list[mx.array | None]
) -> list[Verdict]:
    """logits (B, K+1, V) from one target forward over [pending, drafts...] per row."""
    per_row = []
    pending = []
    for i, r in enumerate(requests):
        k = len(drafts[i])
        lps = slot_logprobs(r.sampler, logits[i, : k + 1], r.history, drafts[i])
        per_row.append(lps)
        pending.append(_decide(r, lps, drafts[i], q[i]))
    mx.eval([x for p in pending for x in (p.picks, p.accept) if x is not None])
    verdicts = []
    for d, lps, p in zip(drafts, per_row, pending, strict=True):
        picks = p.picks.tolist()
        if p.greedy:
            a = next((j for j, tok in enumerate(d) if picks[j] != tok), len(d))
        else:
            flags = p.accept.tolist() if p.accept is not None else []
            a = next((j for j, ok in enumerate(flags) if not ok), len(d))
        tokens = [*d[:a], picks[a]]
        verdicts.append(Verdict(a, tokens, lps[: a + 1]))
    return verdicts


__all__ = ["PURPOSE_SAMPLE", "Verdict", "verify"]
