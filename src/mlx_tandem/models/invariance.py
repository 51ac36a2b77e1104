"""Row-stable projections: a matmul's per-row result must not depend on how many rows it has.

A fast BLAS picks kernels by shape: OpenBLAS here computes a row of `X @ W.T`
differently when X has few rows (gemv and small-matrix paths) than when it has
more, so a row's logits would change with the batch it decodes in, or with how
many draft tokens it verifies. `probe_min_rows` runs a projection on 1..192
rows and finds the smallest row count from which every row equals the same
row computed in a large call. `row_stable(model)` returns a copy of the module
tree (sharing every weight array) whose projections pad their input to their
own stable row count and whose attention layers run the batch-invariant
attention of their row caches (kv/state_rows.rows_model, verified by a probe
forward), so the rows engine's arithmetic is the same for every batch shape;
the plain path keeps using the untouched model.

Oracle: tests/test_invariance.py, tests/test_attention_routing.py and the
engine exactness tests (tests/test_engine.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem.kv.state_rows import rows_model

PROBE_ROWS = (*range(1, 33), 40, 48, 64, 96, 128, 144, 160, 192)
REFERENCE_ROWS = 256
PROJECTIONS = (nn.Linear, nn.QuantizedLinear)


def probe_min_rows(
    fn: Callable[[mx.array], mx.array], in_dims: int, dtype: mx.Dtype = mx.float32
) -> int:
    """Smallest row count from which fn's per-row results no longer depend on the row count."""
    x = mx.random.normal((REFERENCE_ROWS, in_dims), key=mx.random.key(in_dims)).astype(dtype)
    ref = fn(x)
    mx.eval(ref)
    unstable = [m for m in PROBE_ROWS if not mx.array_equal(fn(x[:m]), ref[:m]).item()]
    return max(unstable) + 1 if unstable else 1


def _in_dims(m: nn.Module) -> int:
    return m.weight.shape[-1] * (32 // m.bits) if hasattr(m, "bits") else m.weight.shape[-1]


def _dtype(m: nn.Module) -> mx.Dtype:
    return m.scales.dtype if hasattr(m, "scales") else m.weight.dtype


def pad_rows(fn: Callable[[mx.array], mx.array], min_rows: int) -> Callable[[mx.array], mx.array]:
    """fn applied with at least min_rows rows (zero rows added, results dropped)."""
    if min_rows <= 1:
        return fn

    def padded(x: mx.array) -> mx.array:
        lead, rows = x.shape[:-1], x.size // x.shape[-1]
        if rows >= min_rows:
            return fn(x)
        flat = x.reshape(rows, x.shape[-1])
        flat = mx.concatenate([flat, mx.zeros((min_rows - rows, x.shape[-1]), x.dtype)])
        y = fn(flat)[:rows]
        return y.reshape(*lead, y.shape[-1])

    return padded


class RowStableProjection(nn.Module):
    """Wraps a Linear / QuantizedLinear so it never multiplies fewer than `min_rows` rows."""

    def __init__(self, inner: nn.Module, min_rows: int) -> None:
        super().__init__()
        self.inner = inner
        self.min_rows = min_rows
        self._call = pad_rows(inner, min_rows)

    def __call__(self, x: mx.array) -> mx.array:
        return self._call(x)


def row_stable(model: nn.Module) -> tuple[nn.Module, dict[tuple, int]]:
    """The rows engine's copy of `model` (projections padded to stable row counts, attention
    routed to the row caches); the counts. Raises ValueError for a model with an attention
    layer that does not route."""
    needs: dict[tuple, int] = {}

    def need(m: nn.Module) -> int:
        key = (type(m).__name__, tuple(m.weight.shape), getattr(m, "bits", None))
        if key not in needs:
            needs[key] = probe_min_rows(m, _in_dims(m), _dtype(m))
        return needs[key]

    def rebuild(module: nn.Module) -> nn.Module:
        if isinstance(module, PROJECTIONS):
            rows = need(module)
            return module if rows <= 1 else RowStableProjection(module, rows)
        out = copy.copy(module)  # shares arrays; children replaced below, never mutated
        for key, value in module.items():
            if isinstance(value, nn.Module):
                out[key] = rebuild(value)
            elif isinstance(value, list) and any(isinstance(v, nn.Module) for v in value):
                out[key] = [rebuild(v) if isinstance(v, nn.Module) else v for v in value]
        return out

    return rows_model(rebuild(model)), needs
