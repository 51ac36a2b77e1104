"""Batch-invariant attention and the hook that lets a cache own its attention.

mlx-lm's model files call `scaled_dot_product_attention(q, k, v, cache=..., ...)`
imported from `mlx_lm.models.base`. `install_attention_dispatch(model)` rebinds
that name in the model's own modules to a dispatcher: a cache that has an
`attend` method computes attention itself; every other cache (mlx-lm's own,
or none) goes to the original function unchanged, so plain mlx-lm behaviour
is bit-for-bit preserved. Cache layouts (per-row ends, codecs) thus supply the
numerics for their own storage, as the seed's `KvDonorAttention.attend` does.

`invariant_attention` is the arithmetic the rows engine uses. Under a fast
BLAS (OpenBLAS), a matmul's per-row result depends on the call's shape, so
`softmax(q k^T) v` for a row changes with the batch size, the number of query
positions and the key width. Measured on this machine (tests/test_invariance.py):
padding queries to a fixed count (so the score matmul always has the same row
count) and computing `p v` as `v^T p^T` (row count = head dim, fixed) makes a
row's output identical alone, in any batch, for 1 or k query positions, at
any key width.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

QUERY_ROW_CHOICES = (1, 2, 4, 8, 16)  # queries per (row, kv head) are padded to one of these
KEY_CHUNK = 256  # `p v` is summed over fixed-size key chunks, in order


def invariant_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    valid: mx.array,
    query_rows: int | None = None,
) -> mx.array:
    """queries (B, H, L, D); keys/values (B, Hkv, W, D); valid (B, 1, L, W) bool -> (B, H, L, D).

    Shape rules that keep a row's arithmetic independent of the batch:
      * scores `q k^T`: queries padded to `query_rows` per kv head (the
        smallest count this BLAS is shape-stable at, probed once per head
        shape), so the matmul's row count never changes; its inner dimension
        is the head dim;
      * `p v`: keys split into KEY_CHUNK-wide chunks, each chunk's `p_c v_c` a
        matmul of one fixed shape (a BLAS splits a long inner dimension at
        points that depend on its total length), chunk results added in order,
        so trailing masked chunks add exact zeros.
    """
    B, H, L, D = queries.shape
    Hkv = keys.shape[1]
    rep = H // Hkv
    if query_rows is None:
        query_rows = stable_query_rows(D, H, Hkv, str(queries.dtype))
    Lp = max(L, query_rows)
    extra = -keys.shape[2] % KEY_CHUNK
    if extra:
        zeros = mx.zeros((B, Hkv, extra, D), keys.dtype)
        keys = mx.concatenate([keys, zeros], axis=2)
        values = mx.concatenate([values, zeros.astype(values.dtype)], axis=2)
        valid = mx.concatenate([valid, mx.zeros((*valid.shape[:3], extra), mx.bool_)], axis=3)
    W = keys.shape[2]
    q = (queries * scale).reshape(B, Hkv, rep, L, D)
    if Lp > L:  # padding rows only fix the matmul's shape; softmax sees the real rows
        q = mx.concatenate([q, mx.zeros((B, Hkv, rep, Lp - L, D), q.dtype)], axis=3)
    scores = (q.reshape(B, Hkv, rep * Lp, D) @ keys.swapaxes(-1, -2)).reshape(B, Hkv, rep, Lp, W)
    scores = mx.where(valid[:, :, None], scores[:, :, :, :L], mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    if Lp > L:
        probs = mx.concatenate([probs, mx.zeros((B, Hkv, rep, Lp - L, W), probs.dtype)], axis=3)
    n = W // KEY_CHUNK
    chunks = probs.reshape(B, Hkv, rep * Lp, n, KEY_CHUNK).transpose(0, 1, 3, 2, 4)
    parts = chunks @ values.reshape(B, Hkv, n, KEY_CHUNK, D)  # (B, Hkv, n, rep*Lp, D)
    out = parts[:, :, 0]
    for c in range(1, n):
        out = out + parts[:, :, c]
    return out.reshape(B, Hkv, rep, Lp, D)[:, :, :, :L].reshape(B, H, L, D)


def attention_mismatches(
    query_rows: int, lens: list[int], L: int, H: int, Hkv: int, D: int, dtype: mx.Dtype = mx.float32
) -> int:
    """How many (row, query) outputs differ between a batched block call and one-query calls."""
    k1, k2, k3 = mx.random.split(mx.random.key(sum(lens) + L), 3)
    B, S = len(lens), max(lens) + L
    q = mx.random.normal((B, H, L, D), key=k1).astype(dtype)
    k = mx.random.normal((B, Hkv, S, D), key=k2).astype(dtype)
    v = mx.random.normal((B, Hkv, S, D), key=k3).astype(dtype)
    qpos = mx.array(lens)[:, None] + mx.arange(L)[None]
    valid = (mx.arange(S)[None, None] <= qpos[:, :, None])[:, None]
    out = invariant_attention(q, k, v, 0.125, valid, query_rows)
    bad = 0
    for i, n in enumerate(lens):
        for j in range(L):
            w = n + j + 1
            va = (mx.arange(w)[None, None] <= n + j)[:, None]
            alone = invariant_attention(
                q[i : i + 1, :, j : j + 1],
                k[i : i + 1, :, :w],
                v[i : i + 1, :, :w],
                0.125,
                va,
                query_rows,
            )
            bad += not mx.array_equal(alone, out[i : i + 1, :, j : j + 1]).item()
    return bad


@functools.cache
def stable_query_rows(D: int, H: int, Hkv: int, dtype: str) -> int:
    """Smallest query padding at which attention is shape-stable here (memoised probe)."""
    mxdtype = getattr(mx, dtype.rsplit(".", 1)[-1])
    for rows in QUERY_ROW_CHOICES:
        if all(
            attention_mismatches(rows, [70, 300, 700, 3], L, H, Hkv, D, mxdtype) == 0
            for L in (1, 3, 9)
        ):
            return rows
    return QUERY_ROW_CHOICES[-1]


def _dispatcher(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries, keys, values, *args: Any, **kwargs: Any):
        cache = kwargs["cache"] if "cache" in kwargs else (args[0] if args else None)
        attend = getattr(cache, "attend", None)
        if attend is None:
            return original(queries, keys, values, *args, **kwargs)
        scale = kwargs["scale"] if "scale" in kwargs else args[1]
        mask = kwargs["mask"] if "mask" in kwargs else args[2]
        if kwargs.get("sinks") is not None:
            raise ValueError("attention sinks are not supported by mlx-tandem's row caches")
        return attend(queries, keys, values, scale=scale, mask=mask)

    scaled_dot_product_attention.tandem_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def install_attention_dispatch(model: nn.Module) -> int:
    """Route the model's attention calls through cache.attend where present. Idempotent.

    Returns how many of the model's modules use mlx-lm's shared attention
    function (0: the model computes attention its own way and cannot use row caches).
    """
    names = {type(m).__module__ for _, m in model.named_modules()}
    names.add(type(model).__module__)
    found = 0
    for name in sorted(names):
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is None:
            continue
        found += 1
        if not hasattr(fn, "tandem_original"):
            module.scaled_dot_product_attention = _dispatcher(fn)
    return found
