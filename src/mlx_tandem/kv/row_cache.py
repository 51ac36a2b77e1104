"""RowKVCache: one attention layer's keys/values for B rows, each with its own end.

Row i's tokens occupy columns [0, ends[i]) of shared (B, Hkv, capacity, ·)
buffers. Appending L tokens writes each row at its own end (one scatter);
rewinding a row is moving its end back — no data moves, so per-row rewind
after speculative verification costs nothing. Columns past a row's end hold
stale data that the validity mask hides. A sliding-window layer (Gemma 3's
local layers) keeps every column and masks by window, so its arithmetic is
that of the full-attention path.

What a column holds is the layer's KV codec's encoding (kv/codec.py: `fp`
stores the vectors themselves; quantized codecs store their parts). Every
codec encodes each vector on its own, so a verify block's committed columns
are the same however the block was appended and a rejected tail is discarded
by moving ends back. Attention reads the decoded vectors (dequantize-then-
attend, in the codec's attention space: `attend` rotates the queries and
un-rotates the output for a rotating codec); the new tokens are attended
through their encoding too, so a token's arithmetic never depends on whether
it arrived alone or in a block. `fetch` gives the decoded K/V in the model's
own space (the assistant drafter reads donor layers through it).

The cache speaks mlx-lm's cache protocol as the model files use it: `offset`
(per-row positions, read for RoPE before the update), `make_mask`, and
`update_and_fetch`; plus `attend` (see kv/attention.py) so attention runs
with the batch-invariant arithmetic, or — for a one-row cache running its own
prefill chunk (`block`, from the runner's BlockMode) — with fused attention. Ends are
host-side ints: the engine always knows them, so no step needs a device-to-host sync.

Oracle: tests/test_row_cache.py (a row's attention alone == in a batch ==
after rewind and re-append, under each codec); tests/test_state_rows.py (the
same for logits).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.kv.attention import KEY_CHUNK, block_attention, invariant_attention
from mlx_tandem.kv.codec import FP, KVCodec

PAGE = 256  # capacity grows in whole pages
SPAN = KEY_CHUNK  # attention reads key columns in whole chunks

Parts = tuple[mx.array, ...]


def _span(width: int) -> int:
    return -(-width // SPAN) * SPAN


def _scatter(buf: mx.array, new: mx.array, ends: list[int]) -> mx.array:
    L = new.shape[2]
    if len(set(ends)) == 1:
        buf[:, :, ends[0] : ends[0] + L] = new
        return buf
    cols = mx.array(ends, dtype=mx.int32)[:, None, None, None] + mx.arange(L)[None, None, :, None]
    return mx.put_along_axis(buf, mx.broadcast_to(cols, new.shape), new, axis=2)


def _grow(parts: Parts | None, like: Parts, grow: int) -> Parts:
    zeros = tuple(mx.zeros((p.shape[0], p.shape[1], grow, p.shape[3]), p.dtype) for p in like)
    if parts is None:
        return zeros
    return tuple(mx.concatenate([p, z], axis=2) for p, z in zip(parts, zeros, strict=True))


class RowKVCache:
    def __init__(self, window: int | None = None, codec: KVCodec = FP) -> None:
        self.window = window
        self.codec = codec
        self.kparts: Parts | None = None
        self.vparts: Parts | None = None
        self.dtype: mx.Dtype = mx.float32  # the model's K/V dtype (set by the first append)
        self.ends: list[int] = []

    # --- the mlx-lm cache protocol -------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return mx.array(self.ends, dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Validity (B, 1, N, W) of key columns for N new queries per row (built before update)."""
        window = window_size if window_size is not None else self.window
        width = _span(max(self.ends, default=0) + N)
        cols = mx.arange(width)[None, None, :]
        qpos = mx.array(self.ends, dtype=mx.int32)[:, None, None] + mx.arange(N)[None, :, None]
        valid = cols <= qpos
        if window is not None:
            valid = valid & (cols > qpos - window)
        return valid[:, None]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, L = keys.shape[0], keys.shape[2]
        assert len(self.ends) == B, f"cache has {len(self.ends)} rows, input has {B}"
        self.dtype = keys.dtype
        kp, vp = self.codec.key.encode(keys), self.codec.value.encode(values)
        width = _span(max(self.ends) + L)
        self._reserve(width, kp, vp)
        assert self.kparts is not None and self.vparts is not None
        self.kparts = tuple(_scatter(b, n, self.ends) for b, n in zip(self.kparts, kp, strict=True))
        self.vparts = tuple(_scatter(b, n, self.ends) for b, n in zip(self.vparts, vp, strict=True))
        self.ends = [e + L for e in self.ends]
        return self._decoded(width, max(self.ends))

    def _decoded(self, width: int, used: int | None = None) -> tuple[mx.array, mx.array]:
        """Columns [0, width) decoded, in the codec's attention space. A quantized codec
        decodes only the `used` columns and pads with zeros: columns past a row's end are
        masked, so they add exact zeros whatever they hold."""
        assert self.kparts is not None and self.vparts is not None
        if self.codec.is_fp:
            return self.kparts[0][:, :, :width], self.vparts[0][:, :, :width]
        n = width if used is None else min(used, width)
        pad = [(0, 0), (0, 0), (0, width - n), (0, 0)]
        out = []
        for c, parts in ((self.codec.key, self.kparts), (self.codec.value, self.vparts)):
            x = c.decode(tuple(p[:, :, :n] for p in parts), self.dtype)
            out.append(mx.pad(x, pad) if n < width else x)
        return out[0], out[1]

    def attend(
        self, queries, keys, values, scale: float, mask, block: bool = False, sinks=None,
        softcap: float | None = None,
    ) -> mx.array:
        if not isinstance(mask, mx.array):
            raise ValueError("RowKVCache.attend needs the array mask from make_mask")
        queries = self.codec.key.rotate(queries)
        if block:
            assert len(self.ends) == 1, "block attention is for one row's own prefill"
            out = block_attention(queries, keys, values, scale, mask, sinks, softcap)
        else:
            out = invariant_attention(
                queries, keys, values, scale, mask, sinks=sinks, softcap=softcap
            )
        return self.codec.value.unrotate(out)

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
        out = type(self)(self.window, self.codec)
        out.dtype = self.dtype
        return out

    def take_rows(self, idx: list[int]) -> RowKVCache:
        """A new cache holding rows `idx` (in order), trimmed to the pages they use."""
        out = self._empty_like()
        out.ends = [self.ends[i] for i in idx]
        if self.kparts is not None and self.vparts is not None and idx:
            width = min(self.capacity, -(-max(max(out.ends), 1) // PAGE) * PAGE)
            rows = mx.array(idx, dtype=mx.int32)
            out.kparts = tuple(p[rows, :, :width] for p in self.kparts)
            out.vparts = tuple(p[rows, :, :width] for p in self.vparts)
        return out

    @classmethod
    def merge(cls, parts: list[RowKVCache]) -> RowKVCache:
        """Concatenate caches row-wise (capacities padded to the widest)."""
        names = {p.codec.name for p in parts}
        assert len(names) == 1, f"cannot merge row caches of different codecs: {names}"
        out = parts[0]._empty_like()
        out.ends = [e for p in parts for e in p.ends]
        filled = [p for p in parts if p.kparts is not None]
        if not filled:
            return out
        ref = filled[0]
        out.dtype = ref.dtype
        capacity = max(p.capacity for p in filled)

        def padded(p: RowKVCache, which: str) -> Parts:
            mine: Parts | None = getattr(p, which)
            like: Parts = getattr(ref, which)
            if mine is None:
                return tuple(
                    mx.zeros((len(p.ends), a.shape[1], capacity, a.shape[3]), a.dtype) for a in like
                )
            if p.capacity < capacity:
                mine = _grow(mine, mine, capacity - p.capacity)
            return mine

        for which in ("kparts", "vparts"):
            columns = list(zip(*[padded(p, which) for p in parts], strict=True))
            setattr(out, which, tuple(mx.concatenate(list(c), axis=0) for c in columns))
        return out

    def clone(self) -> RowKVCache:
        """A snapshot: shares the (immutable) buffers, copies the ends."""
        c = self._empty_like()
        c.kparts, c.vparts, c.ends = self.kparts, self.vparts, list(self.ends)
        return c
