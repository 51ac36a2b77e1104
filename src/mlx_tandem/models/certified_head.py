"""Certified greedy picks from one fast LM-head call.

The rows engine's head follows a RowPlan (models/invariance.py) so a row's logits never
depend on the call they are computed in; at some row counts that costs much more than the
plain call (measured here: 16 rows 1.2x, 32 rows 2.1x). A greedy row with nothing that
reads its logits needs only the argmax of its exact logits.

Both calls compute each logit as a float32 dot product of the same x and w_v, in some
summation order, and any order lands within γ_n·Σ|x_i·w_vi| ≤ γ_n·‖x‖·‖w_v‖ of the real
value (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1; n the hidden
size, γ_n = n·u / (1 − n·u), u = 2^-24, with or without FMA). So the two results of one
logit differ by at most 2γ_n·‖x‖·‖w_v‖, and where the fast call's top logit t leads
every other v by more than

    2γ_n·‖x‖·(‖w_t‖ + ‖w_v‖) + tie   (+ slack for the check's own rounding),

the exact logits have the same argmax and no rival within `tie` of it: exactly the pick
the exact path makes (engine/verify.py, whose TIE_MARGIN the engine passes as `tie`).
Every other slot is *unsure* and is decided on its row's exact logits (~0.7% of slots on
SmolLM2 chat).

Only for heads that are a float32 `x @ W.T` and nothing else: probed once (the model's
own head on random rows equals the matmul bit for bit), so soft-capping, scaling, a bias
or quantized weights leave a model without a certificate.

Oracle: tests/test_certified_head.py (an adversarial fast head, off by up to the rounding
bound, never changes a certified pick; without the bound it does; the engine's greedy
cohorts with the certificate equal plain decoding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem.models.graph import MlxLmGraph, is_tied

ROUNDING = 1.001  # the norms' and the bound's own float32 rounding, with room
CHECK_SLACK = 2.0**-20  # relative: the comparison `lead > bound` rounds once more
PROBE_ROWS = 5
# the fast call's rows are zero-padded to a multiple of this: OpenBLAS's sgemm ran 16- and
# 32-row calls of SmolLM2's head faster than 12- or 28-row ones here (27 / 29 vs 42 / 49 ms)
PAD_ROWS = 16


@dataclass(frozen=True)
class CertifiedHead:
    weight: mx.array  # (V, D) float32
    norms: mx.array  # (V,) ‖w_v‖, rounded up
    gamma: float  # γ_n for n = D

    def picks(self, hidden: mx.array, tie: float) -> tuple[mx.array, mx.array]:
        """hidden (..., D) → each slot's fast argmax (...) and whether it is unsure (...):
        a rival could lead it, or lie within `tie` of it, in the exact logits."""
        lead, D = hidden.shape[:-1], hidden.shape[-1]
        x = hidden.astype(mx.float32).reshape(-1, D)
        rows = x.shape[0]
        padded = -(-rows // PAD_ROWS) * PAD_ROWS
        if padded > rows:  # zero rows: their picks are dropped below
            x = mx.concatenate([x, mx.zeros((padded - rows, D), x.dtype)])
        picks, unsure = self.judge(x @ self.weight.T, x, tie)
        return picks[:rows].reshape(lead), unsure[:rows].reshape(lead)

    def judge(self, logits: mx.array, x: mx.array, tie: float) -> tuple[mx.array, mx.array]:
        """Picks and unsure flags from logits (..., V) that some order of float32 dot
        products of x (..., D) with the weight's rows gave."""
        top_index = mx.argmax(logits, axis=-1)
        top = mx.take_along_axis(logits, top_index[..., None], axis=-1)
        # v is a rival where l_v + a·‖w_v‖ >= top - a·‖w_t‖ - margin, a = 2γ‖x‖
        a = (2 * self.gamma * ROUNDING) * mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        margin = tie + CHECK_SLACK * mx.abs(top)
        floor = top - a * self.norms[top_index][..., None] - margin
        rivals = mx.sum(logits + a * self.norms >= floor, axis=-1)  # t itself always counts
        unsure = (rivals > 1) | ~mx.isfinite(top[..., 0])
        return top_index, unsure


def head_weight(model: nn.Module, graph: MlxLmGraph) -> mx.array | None:
    """The LM head's weight: the untied `lm_head`'s or the tied token embedding's."""
    if is_tied(model):
        return getattr(graph.embedding, "weight", None)
    head = model.get("lm_head") if isinstance(model, nn.Module) else None
    return getattr(head, "weight", None)


def certify_head(
    head: Callable[[mx.array], mx.array], weight: mx.array | None
) -> CertifiedHead | None:
    """A certificate for `head` (the model's own, unplanned) when it is exactly a float32
    `x @ weight.T`; None otherwise."""
    if weight is None or weight.ndim != 2 or weight.dtype != mx.float32:
        return None
    D = weight.shape[1]
    x = mx.random.normal((1, PROBE_ROWS, D), key=mx.random.key(D)) * 3
    if not mx.array_equal(head(x), x @ weight.T).item():
        return None
    n_u = D * 2.0**-24
    norms = mx.sqrt(mx.sum(weight * weight, axis=-1)) * ROUNDING
    mx.eval(norms)
    return CertifiedHead(weight, norms, n_u / (1 - n_u))
