"""RowKVCache: one attention layer's keys/values for B rows, each with its own end.

Row i's tokens occupy columns [0, ends[i]) of shared (B, Hkv, capacity, ·)
buffers. Appending L tokens writes each row at its own end (one scatter);
rewinding a row is moving its end back — no data moves, so per-row rewind
after speculative verification costs nothing. Columns past a row's end hold
stale data that the validity mask hides.

A sliding-window layer (Gemma 3's local layers) built with a `ring` keeps only
`ring` columns (the window plus the largest append, rounded to whole
pages): position p lives in column p % ring. Appending L <= ring - window
tokens never overwrites a position a query of the block or a later one can see
(the oldest still visible is end - window + 1), and a rejected verify tail
only overwrote positions already outside every later query's window, so rewind
by ends stays free. The validity of a column comes from the position it holds
(`_held`); the layout depends on the row's own positions only, so a row's
arithmetic is the same alone, batched, speculated and warm from the prefix
cache. Without a ring a sliding layer keeps every column and masks by window.

What a column holds is the layer's KV codec's encoding (kv/codec.py: `fp`
stores the vectors themselves; quantized codecs store their parts). Every
codec encodes each vector on its own, so a verify block's committed columns
are the same however the block was appended and a rejected tail is discarded
by moving ends back. Attention reads what is stored, in the codec's attention
space (`attend` rotates the queries and un-rotates the output for a rotating
codec): affine codes multiplied as they are (kv/attention.Packed), other codecs
and block attention decoded; a quantized cache's `update_and_fetch` returns
stand-ins of the decoded shape, and `attend` refuses anything else (a model
that changed them). The new tokens are attended through their encoding too, so
a token's arithmetic never depends on whether it arrived alone or in a block.
`fetch` gives the decoded K/V in the model's own space (the assistant drafter
reads donor layers through it).

Rows come and go between steps (kv/state_rows.py), and the buffers may hold more rows than
the cohort: rows [0, B) are the cohort's, the rest spare (stale, finite data that no row
reads). A joining row is written into a spare row where there is one, so a join no longer
copies every running row's K/V (a 32-row cohort's join copied ~470 MB for SmolLM2, ~50
ms here); a rebuilt buffer keeps `_room` spare rows, and rows leaving from the end only
turn spare; rows leaving from the middle are filled by the rows past the new count
(kv/state_rows.tail_into_holes), so a leave writes only the rows that move.

The cache speaks mlx-lm's cache protocol as the model files use it: `offset`
(per-row positions, read for RoPE before the update), `make_mask`, and
`update_and_fetch`; plus `attend` (see kv/attention.py) so attention runs
with the batch-invariant arithmetic, or — for a one-row cache running its own
prefill chunk (`block`, from the runner's BlockMode) — with fused attention. Ends are
host-side ints: the engine always knows them, so no step needs a device-to-host sync.

Oracle: tests/test_row_cache.py (a row's attention alone == in a batch ==
after rewind and re-append, under each codec; a row joining into a spare row attends
as alone, and a departed row's data never reaches it: control, a newcomer written
without its padding reads NaN); tests/test_state_rows.py (the same for logits, rows
leaving from the tail and joining into spare rows).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.kv.attention import (
    KEY_CHUNK,
    KEY_SPAN,
    Packed,
    block_attention,
    invariant_attention,
)
from mlx_tandem.kv.codec import FP, KVCodec, VectorCodec

PAGE = 256  # capacity grows in whole pages (whole key chunks)
ROOM = 8  # the most spare rows a rebuilt buffer keeps for joining rows (a quarter of its rows)
assert PAGE % KEY_CHUNK == 0 and KEY_CHUNK % KEY_SPAN == 0

Parts = tuple[mx.array, ...]


def _whole(width: int, unit: int) -> int:
    return -(-width // unit) * unit


def _grow(parts: Parts | None, like: Parts, grow: int) -> Parts:
    """`grow` more zero columns for every buffer row (spare ones too); new buffers like `like`."""
    zeros = tuple(mx.zeros((p.shape[0], p.shape[1], grow, p.shape[3]), p.dtype)
                  for p in (like if parts is None else parts))
    if parts is None:
        return zeros
    return tuple(mx.concatenate([p, z], axis=2) for p, z in zip(parts, zeros, strict=True))


def _at_row(buf: mx.array, rows: mx.array, row: int) -> mx.array:
    """buf with `rows` written from buffer row `row` on (a new array: buf is not changed)."""
    return mx.slice_update(buf, rows, mx.array([row, 0, 0, 0]), axes=(0, 1, 2, 3))


def _room(rows: int) -> int:
    """Spare rows a rebuilt buffer of `rows` keeps for joining rows (a quarter, at most ROOM)."""
    return min(ROOM, rows // 4)


def _at_rows(buf: mx.array, rows: mx.array, at: list[int]) -> mx.array:
    """buf with rows[j] written at buffer row at[j]."""
    for j, row in enumerate(at):
        buf = _at_row(buf, rows[j : j + 1], row)
    return buf


def ring_size(window: int, reach: int) -> int:
    """Columns a sliding layer keeps: its window plus the most tokens one append may bring
    (a prefill chunk, a verify block), in whole pages."""
    return _whole(window + reach, PAGE)


class RowKVCache:
    def __init__(
        self, window: int | None = None, codec: KVCodec = FP, ring: int | None = None
    ) -> None:
        assert ring is None or (window is not None and ring > window and ring % PAGE == 0)
        self.window = window
        self.codec = codec
        self.ring = ring  # columns kept by a sliding layer (None: every column)
        self.kparts: Parts | None = None
        self.vparts: Parts | None = None
        self.dtype: mx.Dtype = mx.float32  # the model's K/V dtype (set by the first append)
        self.ends: list[int] = []
        self._handed: tuple[mx.array, ...] = ()  # the K/V the last update handed the model

    # --- the mlx-lm cache protocol -------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return mx.array(self.ends, dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Validity (B, 1, N, W) of key columns for N new queries per row (built before update)."""
        window = window_size if window_size is not None else self.window
        return self._valid(self.ends, N, window)

    def _width(self, used: int, unit: int = KEY_SPAN) -> int:
        """Key columns attention scores when the widest row holds `used` positions (whole
        spans); with unit=KEY_CHUNK, the value columns its `p v` reads (whole chunks)."""
        return _whole(used, unit) if self.ring is None else min(self.ring, _whole(used, unit))

    def _held(self, last: mx.array, width: int) -> mx.array:
        """(B, 1, W) position each column holds for rows whose last written position is
        `last` (B, 1, 1); negative: never written. Linear layout: column c holds position c
        (columns past a row's end are masked by the causal rule)."""
        cols = mx.arange(width)[None, None, :]
        if self.ring is None:
            return cols
        return last - mx.remainder(last - cols, self.ring)

    def _valid(self, starts: list[int], N: int, window: int | None) -> mx.array:
        """Validity (B, 1, N, W) for queries at starts[i] + j (j < N), the block written."""
        if self.ring is not None:
            assert window == self.window, "a ring cache masks with its own window"
        start = mx.array(starts, dtype=mx.int32)[:, None, None]
        qpos = start + mx.arange(N)[None, :, None]
        pos = self._held(start + N - 1, self._width(max(starts, default=0) + N))
        valid = (pos >= 0) & (pos <= qpos)
        if window is not None:
            valid = valid & (pos > qpos - window)
        return valid[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, L = keys.shape[0], keys.shape[2]
        assert len(self.ends) == B, f"cache has {len(self.ends)} rows, input has {B}"
        assert self._fits(L), f"an append of {L} tokens is wider than the ring's slack"
        self.dtype = keys.dtype
        kp, vp = self.codec.key.encode(keys), self.codec.value.encode(values)
        width = self._width(max(self.ends) + L)
        self._reserve(self._width(max(self.ends) + L, KEY_CHUNK), kp, vp)
        assert self.kparts is not None and self.vparts is not None
        cols = self._columns(L)
        self.kparts = tuple(self._scatter(b, n, cols) for b, n in zip(self.kparts, kp, strict=True))
        self.vparts = tuple(self._scatter(b, n, cols) for b, n in zip(self.vparts, vp, strict=True))
        self.ends = [e + L for e in self.ends]
        if self.codec.is_fp:
            self._handed = self.kparts[0][:B, :, :width], self.vparts[0][:B, :, :width]
            return self._handed
        # A quantized cache hands the model stand-ins of the decoded K/V's shape: its
        # attention reads the stored parts (`attend`), so no step builds a decode of
        # every column that nothing evaluates.
        self._handed = tuple(mx.zeros((B, x.shape[1], width, x.shape[3]), x.dtype)
                             for x in (keys, values))  # one lazy op each, never evaluated
        return self._handed

    def _chunked(self) -> int:
        """Value columns the rows attention's `p v` reads (whole key chunks; the columns past
        the scored keys weigh 0)."""
        return self._width(max(self.ends), KEY_CHUNK)

    def _fits(self, L: int) -> bool:
        """Whether appending L tokens keeps every position a query can still see."""
        return self.ring is None or (self.window is not None and self.ring - self.window >= L)

    def _columns(self, L: int) -> int | mx.array:
        """Where an append of L tokens goes: the first column when every row writes the
        same contiguous columns, else (rows held, 1, L, 1) each buffer row's columns (modulo
        the ring; spare rows write at column 0, which no row reads)."""
        ends = self.ends
        if len(set(ends)) == 1 and (self.ring is None or ends[0] % self.ring + L <= self.ring):
            return ends[0] if self.ring is None else ends[0] % self.ring
        assert self.kparts is not None
        spare = self.kparts[0].shape[0] - len(ends)
        cols = mx.array(ends + [0] * spare, dtype=mx.int32)[:, None, None, None]
        cols = cols + mx.arange(L)[None, None, :, None]
        return cols if self.ring is None else mx.remainder(cols, self.ring)

    @staticmethod
    def _scatter(buf: mx.array, new: mx.array, cols: int | mx.array) -> mx.array:
        """buf with each row's new columns written at `cols` (from `_columns`); a new array
        (clones share buffers), written in place when nothing else holds buf."""
        if isinstance(cols, int):
            return mx.slice_update(buf, new, mx.array([0, 0, cols, 0]), axes=(0, 1, 2, 3))
        spare = buf.shape[0] - new.shape[0]
        if spare:  # spare rows take zeros at the columns `_columns` gave them
            new = mx.pad(new, [(0, spare), (0, 0), (0, 0), (0, 0)])
        return mx.put_along_axis(buf, mx.broadcast_to(cols, new.shape), new, axis=2)

    def _decoded(self, width: int, used: int | None = None) -> tuple[mx.array, mx.array]:
        """Columns [0, width) decoded, in the codec's attention space (`used`: see _decode)."""
        assert self.kparts is not None and self.vparts is not None
        B = len(self.ends)
        if self.codec.is_fp:
            return self.kparts[0][:B, :, :width], self.vparts[0][:B, :, :width]
        return (self._decode(self.codec.key, self.kparts, width, used),
                self._decode(self.codec.value, self.vparts, width, used))

    def _decode(self, codec: VectorCodec, parts: Parts, width: int, used: int | None) -> mx.array:
        """One tensor's columns [0, width) decoded. Only the `used` columns are decoded and
        the rest padded with zeros: columns past a row's end are masked, so they add exact
        zeros whatever they hold."""
        n = width if used is None else min(used, width)
        x = codec.decode(tuple(p[: len(self.ends), :, :n] for p in parts), self.dtype)
        return mx.pad(x, [(0, 0), (0, 0), (0, width - n), (0, 0)]) if n < width else x

    def attend(
        self, queries, keys, values, scale: float, mask, block: bool = False, sinks=None,
        softcap: float | None = None,
    ) -> mx.array:
        if not isinstance(mask, mx.array):
            raise ValueError("RowKVCache.attend needs the array mask from make_mask")
        # mlx-lm's sliding models build the sliding mask from a sliding layer's cache (here a
        # ring: the ring's validity). A mask from an every-column cache is the same until a
        # row wraps, and from then on wider than the ring's keys: refused, never misread.
        if mask.shape[-1] != keys.shape[2]:
            raise ValueError(
                f"attention mask covers {mask.shape[-1]} key columns, the cache holds "
                f"{keys.shape[2]}: build it with this layer's cache.make_mask"
            )
        if not self.codec.is_fp:
            keys, values = self._stored(keys, values, block)
        elif not block and self._handed and values is self._handed[1]:
            values = self.vparts[0][: len(self.ends), :, : self._chunked()]  # whole key chunks
        queries = self.codec.key.rotate(queries)
        if block:
            assert len(self.ends) == 1, "block attention is for one row's own prefill"
            out = block_attention(queries, keys, values, scale, mask, sinks, softcap)
        else:
            out = invariant_attention(
                queries, keys, values, scale, mask, sinks=sinks, softcap=softcap
            )
        return self.codec.value.unrotate(out)

    def _stored(self, keys: mx.array, values: mx.array, block: bool) -> tuple[mx.array | Packed, ...]:
        """What a quantized cache attends for the stand-ins `update_and_fetch` handed out:
        the stored affine codes as they are (rows attention), else the decoded columns."""
        if len(self._handed) != 2 or keys is not self._handed[0] or values is not self._handed[1]:
            raise ValueError(
                "a quantized KV cache attends only the keys and values its update_and_fetch "
                "returned; this model changes them first: use --kv-codec fp for it"
            )
        assert self.kparts is not None and self.vparts is not None
        used, scored = max(self.ends), keys.shape[2]
        out: list[mx.array | Packed] = []
        for c, parts, width in ((self.codec.key, self.kparts, scored),
                                (self.codec.value, self.vparts, scored if block else self._chunked())):
            packed = None if block else c.packed(tuple(p[: len(self.ends), :, :width]
                                                       for p in parts))
            out.append(self._decode(c, parts, width, used) if packed is None else packed)
        return out[0], out[1]

    @property
    def state(self) -> list[mx.array]:
        return [*(self.kparts or ()), *(self.vparts or ())]

    # --- reading (drafters, memory accounting) --------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.kparts is None else self.kparts[0].shape[2]

    def fetch(self, width: int | None = None) -> tuple[mx.array, mx.array]:
        """Decoded keys and values of columns [0, width) in the model's own space."""
        assert self.kparts is not None, "the cache holds no K/V yet"
        keys, values = self._decoded(self.capacity if width is None else width)
        return self.codec.key.unrotate(keys), self.codec.value.unrotate(values)

    def committed(self, window: int | None) -> tuple[mx.array, mx.array, mx.array]:
        """Decoded K/V (model space) and validity (B, 1, 1, W) for one query per row at its
        end reading the row's committed keys (positions < end; within `window` if given).
        A row holding nothing reads one zero key (its softmax stays finite)."""
        assert self.kparts is not None, "the cache holds no K/V yet"
        if self.ring is not None and (window is None or window > self.window):
            raise ValueError(
                f"a sliding layer keeps only its last {self.window} positions; "
                f"it cannot be read with window {window}"
            )
        width = min(self.capacity, self._width(max(*self.ends, 1)))
        end = mx.array(self.ends, dtype=mx.int32)[:, None, None]
        pos = self._held(end - 1, width)
        valid = (pos >= 0) & (pos < end)
        if window is not None:
            valid = valid & (pos > end - window)
        valid = valid | ((end == 0) & (mx.arange(width) == 0))
        keys, values = self.fetch(width)
        return keys, values, valid[:, None]

    def columns(self, start: int, end: int) -> tuple[Parts, Parts]:
        """The stored parts of one row's positions [start, end) (still held: a ring keeps
        the last `ring` positions), as views."""
        assert self.kparts is not None and self.vparts is not None and len(self.ends) == 1
        assert start >= 0 and end <= self.ends[0]
        assert self.ring is None or self.ends[0] - start <= self.ring, "positions no longer held"
        if self.ring is None:
            cols: slice | mx.array = slice(start, end)
        else:
            cols = mx.remainder(mx.arange(start, end), self.ring)
        return (tuple(p[:1, :, cols] for p in self.kparts),
                tuple(p[:1, :, cols] for p in self.vparts))

    def place(self, kparts: Parts, vparts: Parts, dtype: mx.Dtype) -> None:
        """Fill this blank one-row cache from the stored parts of positions [0, n): the
        columns a row that appended them holds (a ring keeps the last `ring`), zero-padded
        to whole pages as appends leave them."""
        assert self.ends == [0] and self.kparts is None
        n = total = kparts[0].shape[2]
        capacity = -(-n // PAGE) * PAGE
        if self.ring is not None and n > self.ring:
            slots = self._held(mx.array([[[n - 1]]], dtype=mx.int32), self.ring).reshape(-1)
            kparts, vparts = (tuple(p[:, :, slots] for p in x) for x in (kparts, vparts))
            n = capacity = self.ring
        pad = [(0, 0), (0, 0), (0, capacity - n), (0, 0)]
        self.kparts = tuple(mx.pad(p, pad) for p in kparts)
        self.vparts = tuple(mx.pad(p, pad) for p in vparts)
        self.dtype, self.ends = dtype, [total]

    @property
    def keys(self) -> mx.array | None:
        """Every column's keys, decoded (for an fp cache: the buffer itself)."""
        return None if self.kparts is None else self.fetch()[0]

    @property
    def values(self) -> mx.array | None:
        return None if self.vparts is None else self.fetch()[1]

    # --- row operations (used by StateRows) -----------------------------------------
    def _reserve(self, width: int, kp: Parts, vp: Parts) -> None:
        capacity = self.capacity
        if width <= capacity:
            return
        grow = -(-width // PAGE) * PAGE - capacity
        self.kparts = _grow(self.kparts, kp, grow)
        self.vparts = _grow(self.vparts, vp, grow)

    def set_ends(self, ends: list[int]) -> None:
        """Rewind (or confirm) each row's end; ends may only move back."""
        assert len(ends) == len(self.ends) and all(
            n <= e for n, e in zip(ends, self.ends, strict=True)
        ), "set_ends can only rewind rows"
        self.ends = list(ends)

    def _empty_like(self) -> RowKVCache:
        out = type(self)(self.window, self.codec, self.ring)
        out.dtype = self.dtype
        return out

    def take_rows(self, idx: list[int]) -> RowKVCache:
        """A new cache holding rows `idx` (in that order). Where each row either stays in its
        buffer row or comes from past the new count (rows leaving in
        state_rows.tail_into_holes order) and the rows fill more than half the columns, the
        buffer is kept: only the rows that move are written (in place once nothing else
        holds it) and the rest turn spare, while the spares stay at most the rows kept (one
        row taken out of a larger cohort is gathered: it does not keep the cohort's buffer
        alive). Otherwise the rows are gathered into a buffer trimmed to the pages they
        use, with `_room` spare rows for rows joining later."""
        out = self._empty_like()
        out.ends = [self.ends[i] for i in idx]
        if self.kparts is None or self.vparts is None or not idx:
            return out
        n = len(idx)
        used = max(*out.ends, 1) if self.ring is None else min(max(*out.ends, 1), self.ring)
        width = min(self.capacity, -(-used // PAGE) * PAGE)
        holes = [p for p, i in enumerate(idx) if i != p]
        if (all(idx[p] >= n for p in holes) and len(set(idx)) == n
                and 2 * width > self.capacity and self.kparts[0].shape[0] <= 2 * n):
            out.kparts, out.vparts = self.kparts, self.vparts
            if holes:
                src = mx.array([idx[p] for p in holes], dtype=mx.int32)
                rows = [p[src] for p in (*self.kparts, *self.vparts)]
                mx.eval(rows)  # read before the buffer is written, or the write copies it all
                k = len(self.kparts)
                out.kparts, out.vparts = (tuple(_at_rows(p, r, holes) for p, r in pairs)
                                          for pairs in (zip(self.kparts, rows[:k], strict=True),
                                                        zip(self.vparts, rows[k:], strict=True)))
            return out
        rows = mx.array(idx + idx[:1] * _room(n), dtype=mx.int32)  # spares: copies
        out.kparts = tuple(p[rows, :, :width] for p in self.kparts)
        out.vparts = tuple(p[rows, :, :width] for p in self.vparts)
        return out

    @classmethod
    def merge(cls, parts: list[RowKVCache]) -> RowKVCache:
        """Concatenate caches row-wise (capacities padded to the widest). Where the first
        has the widest capacity and spare rows for all the others, they are written into
        its spare rows and its own rows are not copied; else one new buffer holds every row
        (each copied once) and `_room` spare rows. A row is written whole (zero-padded):
        no column of a spare row keeps a departed row's data (were it not finite, a masked
        column's zero weight would not cancel it)."""
        names = {p.codec.name for p in parts}
        assert len(names) == 1, f"cannot merge row caches of different codecs: {names}"
        out = parts[0]._empty_like()
        out.ends = [e for p in parts for e in p.ends]
        filled = [p for p in parts if p.kparts is not None]
        if not filled:
            return out
        out.dtype = filled[0].dtype
        capacity = max(p.capacity for p in filled)
        first, rows = parts[0], len(out.ends)
        into = first.kparts is not None and first.capacity == capacity and (
            first.kparts[0].shape[0] >= rows)
        for which in ("kparts", "vparts"):
            if into:
                merged, row, rest = list(getattr(first, which)), len(first.ends), parts[1:]
            else:
                merged = [mx.zeros((rows + _room(rows), x.shape[1], capacity, x.shape[3]), x.dtype)
                          for x in getattr(filled[0], which)]
                row, rest = 0, parts
            for p in rest:
                n, mine = len(p.ends), getattr(p, which)
                if mine is not None:
                    pad = [(0, 0), (0, 0), (0, capacity - p.capacity), (0, 0)]
                    merged = [_at_row(buf, mx.pad(m[:n], pad), row)
                              for buf, m in zip(merged, mine, strict=True)]
                elif into:  # whole rows, zeros where a row holds nothing: no stale data stays
                    merged = [_at_row(buf, mx.zeros((n, *buf.shape[1:]), buf.dtype), row)
                              for buf in merged]
                row += n
            setattr(out, which, tuple(merged))
        return out

    def clone(self) -> RowKVCache:
        """A snapshot: shares the (immutable) buffers, copies the ends."""
        c = self._empty_like()
        c.kparts, c.vparts, c.ends = self.kparts, self.vparts, list(self.ends)
        return c
