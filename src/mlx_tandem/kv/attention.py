"""Batch-invariant attention and the per-copy hook that lets a row cache own attention.

mlx-lm's attention modules call `scaled_dot_product_attention(q, k, v, cache=...,
scale=..., mask=...)`, a global of their model file bound to
`mlx_lm.models.base.scaled_dot_product_attention`. `route_attention(model)`
returns a structural copy of the model (sharing every array) in which each such
module gets its own subclass whose `__call__` is the same code over a globals
dict where that name is the layer's `AttentionRoute`. The route binds the
arguments by name and hands them to `cache.attend`. Nothing process-wide
changes: mlx-lm's modules, their classes and the original model are untouched,
so the plain path stays bit-identical to mlx-lm. Whether every attention layer
really routes is checked by a probe forward (kv/state_rows.rows_model).

`invariant_attention` is the arithmetic the rows engine uses. Under a fast
BLAS (OpenBLAS), a matmul's per-row result depends on the call's shape, so
`softmax(q k^T) v` for a row changes with the batch size, the number of query
positions and the key width. Measured on this machine (tests/test_invariance.py):
padding queries to a fixed count (so the score matmul always has the same row
count) and computing `p v` over fixed-width key chunks makes a row's output
identical alone, in any batch, for 1 or k query positions, at any key width.

Oracle: tests/test_invariance.py (the arithmetic), tests/test_attention_routing.py
(every layer routes, a layer that does not is refused by name, mlx-lm untouched).
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base

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


SDPA_NAME = "scaled_dot_product_attention"
_SDPA = mlx_lm_base.scaled_dot_product_attention
_SDPA_SIGNATURE = inspect.signature(_SDPA)


class AttentionRoute:
    """One attention layer's `scaled_dot_product_attention` in the rows engine's model copy.

    Arguments are bound by name against mlx-lm's signature, so positional and
    keyword call styles read the same `cache`, `scale`, `mask` and `sinks`.
    """

    def __init__(self, layer: str) -> None:
        self.layer = layer
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        self.calls += 1
        if a["sinks"] is not None:
            raise ValueError(
                f"{self.layer} uses attention sinks (as gpt_oss does); mlx-tandem's row caches "
                "do not support attention sinks"
            )
        attend = getattr(a["cache"], "attend", None)
        if attend is None:  # the copy runs only on row caches; anything else would be inexact
            raise ValueError(
                f"{self.layer} got a {type(a['cache']).__name__} cache; the rows engine's model "
                "copy runs only on row caches"
            )
        return attend(a["queries"], a["keys"], a["values"], scale=a["scale"], mask=a["mask"])


def _routes_through_sdpa(fn: object) -> bool:
    """Whether fn's own code reads mlx-lm's attention function as a global name."""
    return (
        isinstance(fn, types.FunctionType)
        and SDPA_NAME in fn.__code__.co_names
        and fn.__globals__.get(SDPA_NAME) is _SDPA
    )


def _routed_class(cls: type, route: AttentionRoute) -> type:
    """A subclass of cls whose `__call__` resolves the attention function to `route`."""
    fn = cls.__call__
    call = types.FunctionType(
        fn.__code__, {**fn.__globals__, SDPA_NAME: route}, fn.__name__, fn.__defaults__,
        fn.__closure__,
    )
    call.__kwdefaults__ = fn.__kwdefaults__
    call.__qualname__ = fn.__qualname__
    return type(
        cls.__name__,
        (cls,),
        {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
         "attention_route": route},
    )


def attention_route(module: nn.Module) -> AttentionRoute | None:
    """The route of a module of a `route_attention` copy (None for every other module)."""
    return type(module).__dict__.get("attention_route")


def route_attention(model: nn.Module) -> nn.Module:
    """A structural copy of `model` whose attention modules call their cache's `attend`.

    Every module is shallow-copied (arrays are shared; children are replaced in
    the copy, never mutated in `model`); a module whose class's `__call__` reads
    mlx-lm's `scaled_dot_product_attention` gets a per-layer routed subclass.
    Modules that compute attention any other way are left as they are: the
    probe forward in `kv.state_rows.rows_model` finds and refuses them.
    """

    def rebuild(module: nn.Module, path: str) -> nn.Module:
        out = copy.copy(module)
        if _routes_through_sdpa(type(module).__call__):
            out.__class__ = _routed_class(type(module), AttentionRoute(path))
        for key, value in module.items():
            where = f"{path}.{key}" if path else key
            if isinstance(value, nn.Module):
                out[key] = rebuild(value, where)
            elif isinstance(value, list) and any(isinstance(v, nn.Module) for v in value):
                out[key] = [
                    rebuild(v, f"{where}.{i}") if isinstance(v, nn.Module) else v
                    for i, v in enumerate(value)
                ]
        return out

    return rebuild(model, "")
