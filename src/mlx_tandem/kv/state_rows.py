"""StateRows: the seed's `MlxStateRows` — every layer's state for a cohort of B rows.

One object owns the per-layer caches of the cohort and offers the row
operations the engines need. Each layer-cache kind implements two primitives,
gather rows and concatenate, and a snapshot:

  * `RowKVCache` for mlx-lm's `KVCache` and `RotatingKVCache` (window in the mask);
  * mlx-lm's own `ArraysCache` for recurrent layers (layers rebind its arrays,
    so a snapshot that keeps references is safe);
  * `CacheList` of either, recursively.

`rows_model(model)` builds the model copy these caches run on: attention routed
to `RowKVCache.attend` (kv/routing.route_attention), accepted only after a
probe forward shows that every attention layer routes.

Rows leave in `leaving_order` (`tail_into_holes`: the survivors past the new count move
into the holes), so a row cache copies only the rows that move.

Oracle: tests/test_state_rows.py (rows alone vs in a cohort, through append,
filter, extract, merge and clone; a failed append leaves the cohort untouched;
rows leaving in tail-into-holes order),
tests/test_attention_routing.py (the probe).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from mlx_tandem.kv.attention import BlockMode
from mlx_tandem.kv.codec import FP, KVCodec
from mlx_tandem.kv.recurrent import rewind
from mlx_tandem.kv.routing import attention_route, route_attention
from mlx_tandem.kv.row_cache import RowKVCache, ring_size
from mlx_tandem.kv.row_groups import GroupedKVCache, merge_groups

LayerCache = Any  # RowKVCache | ArraysCache | CacheList
CodecPlan = Callable[[int, "int | None"], KVCodec]  # (layer, window) -> that layer's codec


def _fp_plan(layer: int, window: int | None) -> KVCodec:
    return FP


@dataclass
class PreparedChange:
    """A computed but not yet applied change: `commit()` applies it, `dispose()` drops it."""

    commit: Callable[[], None]
    dispose: Callable[[], None]


@dataclass(frozen=True)
class RowSpan:
    """One row's state over its columns [start, end): per leaf (StateRows.leaves order), an
    attention layer's stored parts of those columns (k parts, v parts, the K/V dtype) or a
    recurrent layer's arrays at `end`. Fresh copies: nothing else holds their buffers."""

    start: int
    end: int
    leaves: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        total = 0
        for leaf in self.leaves:
            arrays = [*leaf[0], *leaf[1]] if isinstance(leaf, tuple) else leaf
            total += sum(a.nbytes for a in arrays if a is not None)
        return total


# --- per-kind primitives ----------------------------------------------------------
def tail_into_holes(keep: list[int]) -> list[int]:
    """The surviving rows `keep` (ascending) in the order that moves fewest buffer rows:
    a survivor below the new row count stays where it is and the survivors past it fill
    the holes, in order (row caches then move only those rows: RowKVCache.take_rows).
    Any order is exact: a row's arithmetic does not depend on where it sits."""
    n, kept = len(keep), set(keep)
    movers = iter(i for i in keep if i >= n)
    return [p if p in kept else next(movers) for p in range(n)]


def _row_kind(
    cache: Any,
    kv: type[RowKVCache] = RowKVCache,
    layer: int = 0,
    plan: CodecPlan = _fp_plan,
    reach: int | None = None,
) -> LayerCache:
    if type(cache) is KVCache:
        return kv(None, plan(layer, None))
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise ValueError("RotatingKVCache with keep > 0 is not supported by the rows engine")
        window = cache.max_size
        ring = None if reach is None else ring_size(window, reach)
        return kv(window, plan(layer, window), ring)
    if type(cache) is ArraysCache:
        return ArraysCache(len(cache.cache))
    if type(cache) is CacheList:
        return CacheList(*[_row_kind(c, kv, layer, plan, reach) for c in cache.caches])
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
    if isinstance(first, RowKVCache):  # rows of very different capacity: groups (kv/row_groups)
        return merge_groups(parts)
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
        out = cache._empty_like()
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
    def empty(
        cls,
        model: nn.Module,
        plan: CodecPlan = _fp_plan,
        kind: type[RowKVCache] = RowKVCache,
        reach: int | None = None,
    ) -> StateRows:
        """No rows yet; layer kinds mirror mlx-lm's `make_prompt_cache(model)`; `plan` gives
        each attention layer's KV codec (default: float); `kind` the row-cache class;
        `reach`: the most tokens one append brings — sliding layers then keep a ring of
        their window plus that (kv/row_cache.ring_size), else every column."""
        caches = make_prompt_cache(model)
        return cls([_row_kind(c, kind, i, plan, reach) for i, c in enumerate(caches)], 0)

    @classmethod
    def blank(
        cls,
        model: nn.Module,
        rows: int,
        plan: CodecPlan = _fp_plan,
        kind: type[RowKVCache] = RowKVCache,
        reach: int | None = None,
    ) -> StateRows:
        """`rows` rows holding no tokens yet."""
        empty = cls.empty(model, plan, kind, reach)
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

    def leaving_order(self, keep: list[int]) -> list[int]:
        """The order to keep the surviving rows `keep` (ascending) in: `tail_into_holes`,
        or `keep` itself where a layer holds its rows in groups (kv/row_groups.py: a row
        moving between groups would merge them)."""
        if any(isinstance(c, GroupedKVCache) for c in self.leaves()):
            return keep
        return tail_into_holes(keep)

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

    def set_ends(self, ends: list[int], padding: bool = False) -> None:
        """Rewind each row's state to `ends`: attention by end, recurrent layers to the
        per-token checkpoint of their last forward (kv/recurrent.rewind). `padding`: the
        dropped columns are a ragged forward's right padding, which recurrent layers never
        absorbed (masked): only attention ends move."""
        drop = [e - n for e, n in zip(self.ends, ends, strict=True)]
        for c in self.leaves():
            if isinstance(c, RowKVCache):
                c.set_ends(ends)
            elif isinstance(c, ArraysCache) and not padding:
                rewind(c, drop)

    # --- one row's spans (the prefix cache, kv/prefix_cache.py) -------------------------
    def copy_span(self, start: int, end: int | None = None) -> RowSpan:
        """Copy out this one-row state's columns [start, end) (default end: the row's end), as
        stored by each layer's codec, and each recurrent layer's state at the end (which
        exists only at the row's end)."""
        assert self.rows == 1, "copy_span reads a one-row StateRows"
        end = self.ends[0] if end is None else end
        assert 0 <= start < end <= self.ends[0]
        leaves: list[Any] = []
        for c in self.leaves():
            if isinstance(c, RowKVCache):
                k, v = c.columns(start, end)
                leaves.append((tuple(map(copied, k)), tuple(map(copied, v)), c.dtype))
            else:
                assert end == self.ends[0], "a recurrent layer's state exists at the row's end only"
                leaves.append([None if a is None else copied(a) for a in c.cache])
        span = RowSpan(start, end, tuple(leaves))
        mx.eval(
            *[
                a
                for leaf in leaves
                for a in ([*leaf[0], *leaf[1]] if isinstance(leaf, tuple) else leaf)
                if a is not None
            ]
        )
        return span

    def load_spans(self, spans: list[RowSpan]) -> None:
        """Fill this blank one-row state from consecutive spans starting at column 0: the
        row holds their columns (each layer's buffer zero-padded to whole pages, as a row
        that computed them holds) and the last span's recurrent state."""
        assert self.rows == 1 and self.ends == [0] and spans and spans[0].start == 0
        assert all(a.end == b.start for a, b in pairwise(spans))
        for n, c in enumerate(self.leaves()):
            if isinstance(c, RowKVCache):
                parts = [s.leaves[n] for s in spans]
                c.place(_joined([p[0] for p in parts]), _joined([p[1] for p in parts]), parts[0][2])
            else:
                c.cache = list(spans[-1].leaves[n])

    def arrays(self) -> list[mx.array]:
        out: list[mx.array] = []
        for c in self.leaves():
            out.extend(
                a for a in (c.state if isinstance(c, RowKVCache) else c.cache) if a is not None
            )
        return out


def copied(a: mx.array) -> mx.array:
    """A copy of `a` in a buffer of its own (a gather: exact bits). A slice is a view that
    keeps its whole source buffer alive, and mx.contiguous leaves a contiguous view as is."""
    return mx.take(a, mx.arange(a.shape[-1]), axis=-1)


def _joined(pieces: list[tuple[mx.array, ...]]) -> tuple[mx.array, ...]:
    """Column pieces of each part concatenated."""
    return tuple(mx.concatenate(list(columns), axis=2) for columns in zip(*pieces, strict=True))


# --- the model copy the rows run on -----------------------------------------------
class _ProbeKV(RowKVCache):
    """A row cache that records which module writes it and how often `attend` runs on it."""

    def __init__(
        self, window: int | None = None, codec: KVCodec = FP, ring: int | None = None
    ) -> None:
        super().__init__(window, codec, ring)
        self.writer: object = None
        self.attends = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.writer = sys._getframe(1).f_locals.get("self")  # the attention module calling us
        return super().update_and_fetch(keys, values)

    def attend(
        self,
        queries,
        keys,
        values,
        scale: float,
        mask,
        block: bool = False,
        sinks=None,
        softcap: float | None = None,
    ) -> mx.array:
        self.attends += 1
        return super().attend(queries, keys, values, scale, mask, block, sinks, softcap)


def probe_routing(model: nn.Module) -> dict[str, int]:
    """Trace one 2-token forward of `model` (a route_attention copy) on 1-row probe caches.

    Returns each attention layer's route call count. Raises ValueError naming
    the layer when an attention layer writes its row cache but computes
    attention without the route (it would be silently inexact), or when a
    layer never writes its cache. The forward is traced, not evaluated.
    """
    layers = [_blank(_row_kind(c, _ProbeKV), 1) for c in make_prompt_cache(model)]
    names = {id(m): name for name, m in model.named_modules()}
    routes = {name: r for name, m in model.named_modules() if (r := attention_route(m))}
    for r in routes.values():
        r.calls = 0
    model(mx.zeros((1, 2), dtype=mx.int32), cache=layers)
    decoder = getattr(model, "layers", [])
    calls: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for leaf in _leaves([layer]):
            if not isinstance(leaf, _ProbeKV):
                continue
            owner = names.get(id(decoder[i])) if i < len(decoder) else None
            if leaf.writer is None:
                raise ValueError(
                    f"attention layer {owner or i} never writes its row cache; "
                    "the rows engine cannot run this model"
                )
            name = names.get(id(leaf.writer), owner or f"layer {i}")
            route = routes.get(name)
            if not leaf.attends or route is None or not route.calls:
                raise ValueError(
                    f"{name} computes attention without mlx-lm's scaled_dot_product_attention; "
                    "the rows engine cannot make it batch-invariant and refuses this model"
                )
            calls[name] = route.calls
    return calls


def rows_model(model: nn.Module, block: BlockMode | None = None) -> nn.Module:
    """The copy of `model` that runs on StateRows: attention routed, verified by a probe.

    `model` itself (and mlx-lm's modules) stay untouched.
    """
    routed = route_attention(model, block)
    probe_routing(routed)
    return routed
