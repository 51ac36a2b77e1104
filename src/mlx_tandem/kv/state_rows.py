"""StateRows: the seed's `MlxStateRows` — every layer's state for a cohort of B rows.

One object owns the per-layer caches of the cohort and offers the row
operations the engines need. Each layer-cache kind implements two primitives,
gather rows and concatenate, and a snapshot:

  * `RowKVCache` for mlx-lm's `KVCache` and `RotatingKVCache` (window in the mask);
  * mlx-lm's own `ArraysCache` for recurrent layers (layers rebind its arrays,
    so a snapshot that keeps references is safe);
  * `CacheList` of either, recursively.

Oracle: tests/test_state_rows.py (rows alone vs in a cohort, through append,
filter, extract, merge and clone; a failed append leaves the cohort untouched).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from mlx_tandem.kv.attention import install_attention_dispatch
from mlx_tandem.kv.row_cache import RowKVCache

LayerCache = Any  # RowKVCache | ArraysCache | CacheList


@dataclass
class PreparedChange:
    """A computed but not yet applied change: `commit()` applies it, `dispose()` drops it."""

    commit: Callable[[], None]
    dispose: Callable[[], None]


# --- per-kind primitives ----------------------------------------------------------
def _row_kind(cache: Any) -> LayerCache:
    if type(cache) is KVCache:
        return RowKVCache()
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise ValueError("RotatingKVCache with keep > 0 is not supported by the rows engine")
        return RowKVCache(window=cache.max_size)
    if type(cache) is ArraysCache:
        return ArraysCache(len(cache.cache))
    if type(cache) is CacheList:
        return CacheList(*[_row_kind(c) for c in cache.caches])
    raise ValueError(f"cache kind {type(cache).__name__} is not supported by the rows engine")


def _gather(cache: LayerCache, idx: list[int]) -> LayerCache:
    if isinstance(cache, RowKVCache):
        return cache.take_rows(idx)
    if isinstance(cache, CacheList):
        return CacheList(*[_gather(c, idx) for c in cache.caches])
    out = ArraysCache(len(cache.cache))
    rows = mx.array(idx, dtype=mx.int32)
    out.cache = [None if a is None else a[rows] for a in cache.cache]
    return out


def _concat(parts: list[LayerCache], counts: list[int]) -> LayerCache:
    first = parts[0]
    if isinstance(first, RowKVCache):
        return RowKVCache.merge(parts)
    if isinstance(first, CacheList):
        return CacheList(
            *[_concat([p.caches[j] for p in parts], counts) for j in range(len(first.caches))]
        )
    out = ArraysCache(len(first.cache))
    for j in range(len(first.cache)):
        arrays = [p.cache[j] for p in parts]
        ref = next((a for a in arrays if a is not None), None)
        if ref is not None:  # rows that have not run yet hold zero state
            out.cache[j] = mx.concatenate(
                [
                    a if a is not None else mx.zeros((n, *ref.shape[1:]), ref.dtype)
                    for a, n in zip(arrays, counts, strict=True)
                ]
            )
    return out


def _blank(cache: LayerCache, n: int) -> LayerCache:
    if isinstance(cache, RowKVCache):
        out = RowKVCache(cache.window)
        out.ends = [0] * n
        return out
    if isinstance(cache, CacheList):
        return CacheList(*[_blank(c, n) for c in cache.caches])
    return ArraysCache(len(cache.cache))


def _snapshot(cache: LayerCache) -> LayerCache:
    if isinstance(cache, RowKVCache):
        return cache.clone()
    if isinstance(cache, CacheList):
        return CacheList(*[_snapshot(c) for c in cache.caches])
    out = ArraysCache(len(cache.cache))
    out.cache = list(cache.cache)
    return out


def _leaves(layers: list[LayerCache]) -> list[Any]:
    out: list[Any] = []
    for c in layers:
        out.extend(_leaves(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


class StateRows:
    """All layers' state for `row_count` rows."""

    def __init__(self, layers: list[LayerCache], rows: int) -> None:
        self.layers = layers
        self.rows = rows

    @classmethod
    def empty(cls, model: nn.Module) -> StateRows:
        """No rows yet; layer kinds mirror mlx-lm's `make_prompt_cache(model)`."""
        layers = [_row_kind(c) for c in make_prompt_cache(model)]
        uses_kv = any(isinstance(c, RowKVCache) for c in _leaves(layers))
        if uses_kv and not install_attention_dispatch(model):
            raise ValueError(
                f"model type {getattr(model, 'model_type', '?')!r} computes attention without "
                "mlx-lm's scaled_dot_product_attention; the rows engine cannot batch it"
            )
        return cls(layers, 0)

    @classmethod
    def blank(cls, model: nn.Module, rows: int) -> StateRows:
        """`rows` rows holding no tokens yet."""
        empty = cls.empty(model)
        return cls([_blank(c, rows) for c in empty.layers], rows)

    def leaves(self) -> list[Any]:
        """Every layer cache, with CacheLists flattened."""
        return _leaves(self.layers)

    @property
    def row_count(self) -> int:
        return self.rows

    @property
    def ends(self) -> list[int]:
        """Tokens held by each row (from the first attention layer)."""
        kv = [c for c in self.leaves() if isinstance(c, RowKVCache)]
        return list(kv[0].ends) if kv else []

    def _combine(self, parts: list[StateRows]) -> list[LayerCache]:
        parts = [p for p in parts if p.rows > 0]
        counts = [p.rows for p in parts]
        return [_concat([p.layers[j] for p in parts], counts) for j in range(len(self.layers))]

    # --- cohort membership --------------------------------------------------------
    def take(self, idx: list[int]) -> StateRows:
        """A new StateRows holding the given rows, in order."""
        assert all(0 <= i < self.rows for i in idx), f"row index out of range: {idx}"
        return StateRows([_gather(c, idx) for c in self.layers], len(idx))

    def extract_row(self, i: int) -> StateRows:
        return self.take([i])

    def clone(self) -> StateRows:
        """A cheap snapshot: MLX arrays are immutable, so share them; copy the row ends."""
        return StateRows([_snapshot(c) for c in self.layers], self.rows)

    def prepare_append(self, rows: list[StateRows]) -> PreparedChange:
        """Compute the cohort with `rows` appended; nothing changes until commit()."""
        added = sum(r.rows for r in rows)
        if not added:
            return PreparedChange(lambda: None, lambda: None)
        staged = {"layers": self._combine([self, *rows])}

        def commit() -> None:
            self.layers, self.rows = staged.pop("layers"), self.rows + added

        return PreparedChange(commit=commit, dispose=staged.clear)

    def filter_rows(self, keep: list[int]) -> None:
        """Keep only the given rows, in that order; dropped rows' memory is released."""
        if keep != list(range(self.rows)):
            taken = self.take(keep)
            self.layers, self.rows = taken.layers, taken.rows

    def merge_rows(self, rows: list[StateRows]) -> None:
        """Replace the rows by `rows` (e.g. per-row snapshots), in order."""
        assert sum(r.rows for r in rows) == self.rows, "merge_rows must supply every row"
        self.layers = self._combine(rows)

    # --- rewind -----------------------------------------------------------------------
    def restore_rows(self, snapshots: list[StateRows], choice: list[int]) -> None:
        """Row i takes its state from snapshots[choice[i]] (clones of this cohort).

        Attention layers restore the snapshot's end (their data below it is
        never rewritten); recurrent layers gather the snapshot's arrays.
        """
        assert len(choice) == self.rows
        sources = [s.leaves() for s in snapshots]
        picks = mx.array(choice, dtype=mx.int32)
        for n, leaf in enumerate(self.leaves()):
            if isinstance(leaf, RowKVCache):
                leaf.ends = [sources[c][n].ends[i] for i, c in enumerate(choice)]
                continue
            for j, current in enumerate(leaf.cache):
                if current is not None:
                    stacked = mx.stack([src[n].cache[j] for src in sources])
                    leaf.cache[j] = stacked[picks, mx.arange(self.rows)]

    def set_ends(self, ends: list[int]) -> None:
        """Rewind each row's attention state to `ends`."""
        for c in self.leaves():
            if isinstance(c, RowKVCache):
                c.set_ends(ends)

    def arrays(self) -> list[mx.array]:
        out: list[mx.array] = []
        for c in self.leaves():
            out.extend(
                a for a in (c.state if isinstance(c, RowKVCache) else c.cache) if a is not None
            )
        return out
