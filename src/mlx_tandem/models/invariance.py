"""Row-stable projections: a row's `x @ W.T` must not depend on the call it is computed in.

A fast BLAS picks kernels by shape. Measured here, two regimes exist:
  * large-call regime (OpenBLAS's native kernels): few rows take gemv and
    small-matrix paths, but from some row count on every row's result is the
    same whatever the count or the row's position — pad small calls up to it;
  * small-call regime (OpenBLAS forced to its Haswell kernels, as on this
    machine): a row's result depends on its position inside a large call
    (rows 0-5 and 6-11 of a 48-row tile differ), but calls of at most c rows
    all equal the one-row result — split calls into pieces of at most c rows.
`probe_plan` measures a projection once and returns its `RowPlan`.
`row_stable(model)` returns a copy of the module tree (sharing every weight
array) whose projections follow their plans and whose attention layers run the
row caches' batch-invariant attention (kv/state_rows.rows_model, verified by a
probe forward); the plain path keeps using the untouched model.

While `BlockMode.on` (one row's own prefill chunk, whose shape depends on that
row alone), projections make one call of any size: exactness needs only that
the same row always gets the same arithmetic, and a whole chunk is the same
call alone or batched.

Oracle: tests/test_invariance.py (the plan's rows equal one-row / large-call
results; the regime found here is needed), tests/test_attention_routing.py and
the engine exactness tests (tests/test_engine.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem.kv.attention import BlockMode
from mlx_tandem.kv.state_rows import rows_model

PROBE_ROWS = (*range(1, 33), 40, 48, 64, 96, 128, 144, 160, 192)
REFERENCE_ROWS = 256
MAX_PAD = 64  # beyond this, padding costs more than splitting
MAX_CHUNK = 16
PROJECTIONS = (nn.Linear, nn.QuantizedLinear)

Fn = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class RowPlan:
    """How one projection keeps a row's arithmetic independent of the call."""

    pad_to: int = 1  # large-call regime: calls with fewer rows are padded to this many
    chunk: int = 0  # small-call regime (> 0): calls are split into pieces of <= chunk rows


def probe_plan(fn: Fn, in_dims: int, dtype: mx.Dtype = mx.float32) -> RowPlan:
    """Measure fn's regime: the padding from which rows are stable, else the largest exact chunk."""
    x = mx.random.normal((REFERENCE_ROWS, in_dims), key=mx.random.key(in_dims)).astype(dtype)
    ref = fn(x)
    mx.eval(ref)
    if mx.array_equal(fn(x[::-1])[::-1], ref).item():  # no dependence on a row's position
        unstable = [m for m in PROBE_ROWS if not mx.array_equal(fn(x[:m]), ref[:m]).item()]
        first = max(unstable) + 1 if unstable else 1
        for pad in [first, *(m for m in PROBE_ROWS if first < m <= MAX_PAD)]:
            if all(_padded_exact(fn, x, ref, rows, pad) for rows in (1, 2, 3, 5)):
                return RowPlan(pad_to=pad)
    single = mx.concatenate([fn(x[i : i + 1]) for i in range(MAX_CHUNK + 3)])
    chunk = 1
    while chunk < MAX_CHUNK and all(
        mx.array_equal(fn(x[s : s + chunk + 1]), single[s : s + chunk + 1]).item() for s in (0, 3)
    ):
        chunk += 1
    return RowPlan(chunk=chunk)


def _padded_exact(fn: Fn, x: mx.array, ref: mx.array, rows: int, pad: int) -> bool:
    """Whether `rows` rows zero-padded to `pad` (and shifted by 7) get the reference results."""
    if rows >= pad:
        return True
    zeros = mx.zeros((pad - rows, x.shape[-1]), x.dtype)
    return all(
        mx.array_equal(fn(mx.concatenate([x[s : s + rows], zeros]))[:rows], ref[s : s + rows]).item()
        for s in (0, 7)
    )


def _in_dims(m: nn.Module) -> int:
    return m.weight.shape[-1] * (32 // m.bits) if hasattr(m, "bits") else m.weight.shape[-1]


def _dtype(m: nn.Module) -> mx.Dtype:
    return m.scales.dtype if hasattr(m, "scales") else m.weight.dtype


def follow_plan(fn: Fn, plan: RowPlan, block: BlockMode) -> Fn:
    """fn over (..., in) with the plan's padding or splitting applied to the flattened rows."""
    if plan.pad_to <= 1 and plan.chunk == 0:
        return fn

    def planned(x: mx.array) -> mx.array:
        lead, rows = x.shape[:-1], x.size // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        if plan.chunk and rows > plan.chunk and not block.on:
            size = -(-rows // -(-rows // plan.chunk))  # even pieces: every size <= chunk is exact
            y = mx.concatenate([fn(flat[i : i + size]) for i in range(0, rows, size)])
        elif rows < plan.pad_to:
            zeros = mx.zeros((plan.pad_to - rows, x.shape[-1]), x.dtype)
            y = fn(mx.concatenate([flat, zeros]))[:rows]
        else:
            return fn(x)
        return y.reshape(*lead, y.shape[-1])

    return planned


class RowStableProjection(nn.Module):
    """A Linear / QuantizedLinear whose calls follow its probed RowPlan."""

    def __init__(self, inner: nn.Module, plan: RowPlan, block: BlockMode) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan
        self._call = follow_plan(inner, plan, block)

    def __call__(self, x: mx.array) -> mx.array:
        return self._call(x)


def stable_projections(
    model: nn.Module, block: BlockMode
) -> tuple[nn.Module, dict[tuple, RowPlan]]:
    """A copy of `model` (sharing every array) whose projections follow their probed plans."""
    plans: dict[tuple, RowPlan] = {}

    def plan(m: nn.Module) -> RowPlan:
        key = (type(m).__name__, tuple(m.weight.shape), getattr(m, "bits", None))
        if key not in plans:
            plans[key] = probe_plan(m, _in_dims(m), _dtype(m))
        return plans[key]

    def rebuild(module: nn.Module) -> nn.Module:
        if isinstance(module, PROJECTIONS):
            p = plan(module)
            return module if p == RowPlan() else RowStableProjection(module, p, block)
        out = copy.copy(module)  # shares arrays; children replaced below, never mutated
        for key, value in module.items():
            if isinstance(value, nn.Module):
                out[key] = rebuild(value)
            elif isinstance(value, list) and any(isinstance(v, nn.Module) for v in value):
                out[key] = [rebuild(v) if isinstance(v, nn.Module) else v for v in value]
        return out

    return rebuild(model), plans


def row_stable(
    model: nn.Module, block: BlockMode | None = None
) -> tuple[nn.Module, dict[tuple, RowPlan]]:
    """The rows engine's copy of `model` (projections following their plans, attention routed
    to the row caches) and the plans. Raises ValueError for a model with an attention layer
    that does not route."""
    block = block or BlockMode()
    stable, plans = stable_projections(model, block)
    return rows_model(stable, block), plans
