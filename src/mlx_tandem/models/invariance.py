"""How many rows a matmul needs before its per-row arithmetic stops depending on the row count.

A fast BLAS picks kernels by shape: OpenBLAS here computes a row of `X @ W.T`
differently when X has 1-4 rows than when it has more (gemv / small-matrix
paths), so a row's logits would change with the batch it decodes in. This
probe runs each distinct projection of a model (linear layers, quantized or
not, and a tied embedding used as the LM head) on 1…MAX_PROBE rows and finds
the smallest row count from which every row equals the same row computed in a
large call. The rows engine then never runs a batched forward with fewer rows
(models/invariance -> kv/state_rows spare rows).

Oracle: tests/test_invariance.py (rows alone == rows in a batch at min_rows).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

PROBE_ROWS = (*range(1, 33), 40, 48, 64, 96, 128, 144, 160, 192)
REFERENCE_ROWS = 256


def _projections(model: nn.Module) -> list[nn.Module]:
    seen: dict[tuple, nn.Module] = {}
    for _, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            key = (type(m).__name__, tuple(m.weight.shape), getattr(m, "bits", None))
            seen.setdefault(key, m)
    return list(seen.values())


def probe_min_rows(model: nn.Module, head=None) -> int:
    """Smallest row count from which every projection's per-row results are shape-stable."""
    calls = [
        (m, m.weight.shape[-1] * (32 // m.bits) if hasattr(m, "bits") else m.weight.shape[-1])
        for m in _projections(model)
    ]
    if head is not None:
        embed = model.model.embed_tokens
        calls.append((head, embed.weight.shape[-1] * (32 // getattr(embed, "bits", 32))))
    need = 1
    dtype = next(iter(_floating(model)), mx.float32)
    for fn, k in calls:
        x = mx.random.normal((REFERENCE_ROWS, k), key=mx.random.key(k)).astype(dtype)
        ref = fn(x)
        mx.eval(ref)
        unstable = [m for m in PROBE_ROWS if not mx.array_equal(fn(x[:m]), ref[:m]).item()]
        if unstable:
            need = max(need, max(unstable) + 1)
    return need


def _floating(model: nn.Module):
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            yield v.dtype
