"""GroupedKVCache: one attention layer's rows kept in a few row caches of their own capacity.

A `RowKVCache` holds every row in one (B, Hkv, capacity, ·) buffer, so a row that joins
with a long prompt pads every running row to its width: merging a 2,000-token row into 16
short ones wrote 1.6 GB of fresh memory for SmolLM2 (the join step's stall), and every
short row then attended over the long row's columns. Here consecutive rows of similar
capacity share one row cache (a group); a row whose capacity is more than `SPREAD` times
a neighbour's starts a new group, so a join appends a group and copies nothing.

Each group runs its own update and attention, and the outputs are concatenated in row
order. A row's arithmetic does not change: the rows attention gives a row the same bits
whatever the batch and the key width (kv/attention.invariant_attention), and the
projections never see the groups. The validity mask is built for all rows at the widest
group's width and each group reads its rows and its own columns: a column's validity
depends on the row's end and the column alone, never on the width.

The cohort stays at most `MOST_GROUPS` groups: past that, the last two merge (a copy, as
every join was before). Taking rows copies only the groups that lose rows, and merges
neighbours left within `SPREAD` of each other.

Oracle: tests/test_row_groups.py (a long row joining short ones makes a second group and
every row's tokens equal the row alone; rows leave and groups merge; negative control:
a group attending its rows with another group's mask columns is not exact).
"""

from __future__ import annotations

from itertools import pairwise

import mlx.core as mx

from mlx_tandem.kv.row_cache import RowKVCache

SPREAD = 2  # neighbouring rows whose capacities differ by more than this keep separate groups
MOST_GROUPS = 4


class GroupedKVCache(RowKVCache):
    """Rows in `groups` (consecutive row ranges, in order), each a RowKVCache with its own
    capacity. Speaks the row cache's protocol; a one-row or one-group cohort is never one."""

    def __init__(self, groups: list[RowKVCache]) -> None:  # no super().__init__: no buffers
        assert len(groups) > 1 and not any(isinstance(g, GroupedKVCache) for g in groups)
        first = groups[0]
        self.window, self.codec, self.ring = first.window, first.codec, first.ring
        self.kparts = self.vparts = None  # each group holds its own
        self.dtype = first.dtype
        self._handed: tuple[mx.array, ...] = ()
        self.groups = groups

    # --- rows and ends ----------------------------------------------------------------
    @property  # type: ignore[override]
    def ends(self) -> list[int]:
        return [e for g in self.groups for e in g.ends]

    @ends.setter
    def ends(self, ends: list[int]) -> None:
        assert len(ends) == sum(len(g.ends) for g in self.groups)
        for g, (a, b) in zip(self.groups, self._ranges(), strict=True):
            g.ends = list(ends[a:b])

    def set_ends(self, ends: list[int]) -> None:
        for g, (a, b) in zip(self.groups, self._ranges(), strict=True):
            g.set_ends(ends[a:b])

    def _ranges(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for g in self.groups:
            out.append((start, start + len(g.ends)))
            start += len(g.ends)
        return out

    # --- the model's calls --------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B = keys.shape[0]
        assert len(self.ends) == B, f"cache has {len(self.ends)} rows, input has {B}"
        for g, (a, b) in zip(self.groups, self._ranges(), strict=True):
            g.update_and_fetch(keys[a:b], values[a:b])
        self.dtype = keys.dtype
        width = self._width(max(self.ends))
        # stand-ins of the widest group's shape: `attend` reads each group's own K/V
        self._handed = tuple(mx.zeros((B, x.shape[1], width, x.shape[3]), x.dtype)
                             for x in (keys, values))  # one lazy op each, never evaluated
        return self._handed

    def attend(
        self, queries, keys, values, scale: float, mask, block: bool = False, sinks=None,
        softcap: float | None = None,
    ) -> mx.array:
        if len(self._handed) != 2 or keys is not self._handed[0] or values is not self._handed[1]:
            raise ValueError(
                "grouped KV rows attend only the keys and values their update_and_fetch "
                "returned; this model changes them first"
            )
        if not isinstance(mask, mx.array) or mask.shape[-1] != keys.shape[2]:
            raise ValueError("RowKVCache.attend needs the array mask from make_mask")
        outs = []
        for g, (a, b) in zip(self.groups, self._ranges(), strict=True):
            k, v = g._handed
            outs.append(g.attend(queries[a:b], k, v, scale, mask[a:b, ..., : k.shape[2]],
                                 block, sinks, softcap))
        return mx.concatenate(outs)

    @property
    def state(self) -> list[mx.array]:
        return [a for g in self.groups for a in g.state]

    @property
    def capacity(self) -> int:
        return max(g.capacity for g in self.groups)

    def fetch(self, width: int | None = None) -> tuple[mx.array, mx.array]:
        width = self.capacity if width is None else width
        parts = [g.fetch(min(width, g.capacity)) for g in self.groups]
        return tuple(mx.concatenate([_pad(p[i], width) for p in parts]) for i in (0, 1))

    def committed(self, window: int | None) -> tuple[mx.array, mx.array, mx.array]:
        parts = [g.committed(window) for g in self.groups]
        width = max(p[0].shape[2] for p in parts)
        keys, values = (mx.concatenate([_pad(p[i], width) for p in parts]) for i in (0, 1))
        valid = mx.concatenate([_pad(p[2], width, axis=3) for p in parts])
        return keys, values, valid

    # --- row operations -------------------------------------------------------------------
    def _empty_like(self) -> RowKVCache:
        out = RowKVCache(self.window, self.codec, self.ring)
        out.dtype = self.dtype
        return out

    def clone(self) -> RowKVCache:
        return GroupedKVCache([g.clone() for g in self.groups])

    def take_rows(self, idx: list[int]) -> RowKVCache:
        """Rows `idx` in order: groups that keep every row are kept as they are."""
        if any(a >= b for a, b in pairwise(idx)):  # not in order: one group
            return self.flattened().take_rows(idx)
        kept = []
        for g, (a, b) in zip(self.groups, self._ranges(), strict=True):
            mine = [i - a for i in idx if a <= i < b]
            if mine == list(range(b - a)):
                kept.append(g)
            elif mine:
                kept.append(g.take_rows(mine))
        if not kept:
            return self._empty_like()
        return merge_groups(kept)

    def flattened(self) -> RowKVCache:
        """Every row in one row cache (padded to the widest capacity: a copy)."""
        return RowKVCache.merge(self.groups)


def _pad(x: mx.array, width: int, axis: int = 2) -> mx.array:
    if x.shape[axis] >= width:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - x.shape[axis])
    return mx.pad(x, pad)


def _fits(run: list[RowKVCache], p: RowKVCache) -> bool:
    """Whether p joins the run's group: rows holding nothing yet join any group; others
    keep the group's capacities within SPREAD of each other."""
    caps = [c.capacity for c in (*run, p) if c.kparts is not None]
    return not caps or max(caps) <= SPREAD * min(caps)


def merge_groups(parts: list[RowKVCache]) -> RowKVCache:
    """Rows of `parts` concatenated in order: neighbours of close capacity share one row
    cache (one copy, as RowKVCache.merge), others keep groups of their own."""
    pieces: list[RowKVCache] = []
    for p in parts:
        pieces.extend(p.groups if isinstance(p, GroupedKVCache) else [p])
    pieces = [p for p in pieces if p.ends]
    if not pieces:
        return RowKVCache.merge(parts)
    runs: list[list[RowKVCache]] = [[pieces[0]]]
    for p in pieces[1:]:
        if _fits(runs[-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    while len(runs) > MOST_GROUPS:
        runs[-2:] = [runs[-2] + runs[-1]]
    # a group of one piece shares its buffers (immutable) but never its ends with the input
    groups = [r[0].clone() if len(r) == 1 else RowKVCache.merge(r) for r in runs]
    return groups[0] if len(groups) == 1 else GroupedKVCache(groups)

