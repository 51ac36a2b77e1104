"""RowKVCache: one attention layer's keys/values for B rows, each with its own end.

Row i's tokens occupy columns [0, ends[i]) of a shared (B, Hkv, capacity, D)
buffer. Appending L tokens writes each row at its own end (one scatter);
rewinding a row is moving its end back — no data moves, so per-row rewind
after speculative verification costs nothing. Columns past a row's end hold
stale data that the validity mask hides. A sliding-window layer (Gemma 3's
local layers) keeps every column and masks by window, so its arithmetic is
that of the full-attention path.

The cache speaks mlx-lm's cache protocol as the model files use it: `offset`
(per-row positions, read for RoPE before the update), `make_mask`, and
`update_and_fetch`; plus `attend` (see kv/attention.py) so attention runs
with the batch-invariant arithmetic, or — for a one-row cache running its own
prefill chunk (`block`, from the runner's BlockMode) — with fused attention. Ends are host-side ints: the engine
always knows them, so no step needs a device-to-host sync.

Oracle: tests/test_row_cache.py (a row's attention alone == in a batch ==
after rewind and re-append); tests/test_state_rows.py (the same for logits).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.kv.attention import KEY_CHUNK, block_attention, invariant_attention

PAGE = 256  # capacity grows in whole pages
SPAN = KEY_CHUNK  # attention reads key columns in whole chunks


def _span(width: int) -> int:
    return -(-width // SPAN) * SPAN


class RowKVCache:
    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
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
        width = _span(max(self.ends) + L)
        self._reserve(width, keys, values)
        if len(set(self.ends)) == 1:
            e = self.ends[0]
            self.keys[:, :, e : e + L, :] = keys
            self.values[:, :, e : e + L, :] = values
        else:
            cols = (
                mx.array(self.ends, dtype=mx.int32)[:, None, None, None]
                + mx.arange(L)[None, None, :, None]
            )
            cols = mx.broadcast_to(cols, keys.shape)
            self.keys = mx.put_along_axis(self.keys, cols, keys, axis=2)
            self.values = mx.put_along_axis(self.values, cols, values, axis=2)
        self.ends = [e + L for e in self.ends]
        return self.keys[:, :, :width, :], self.values[:, :, :width, :]

    def attend(self, queries, keys, values, scale: float, mask, block: bool = False) -> mx.array:
        if not isinstance(mask, mx.array):
            raise ValueError("RowKVCache.attend needs the array mask from make_mask")
        if block:
            assert len(self.ends) == 1, "block attention is for one row's own prefill"
            return block_attention(queries, keys, values, scale, mask)
        return invariant_attention(queries, keys, values, scale, mask)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    # --- row operations (used by StateRows) -----------------------------------------
    def _reserve(self, width: int, keys: mx.array, values: mx.array) -> None:
        B, Hkv, _, D = keys.shape
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if width <= capacity:
            return
        grow = -(-width // PAGE) * PAGE - capacity
        kz = mx.zeros((B, Hkv, grow, D), keys.dtype)
        vz = mx.zeros((B, values.shape[1], grow, values.shape[3]), values.dtype)
        self.keys = kz if self.keys is None else mx.concatenate([self.keys, kz], axis=2)
        self.values = vz if self.values is None else mx.concatenate([self.values, vz], axis=2)

    def set_ends(self, ends: list[int]) -> None:
        """Rewind (or confirm) each row's end; ends may only move back."""
        assert len(ends) == len(self.ends) and all(
            n <= e for n, e in zip(ends, self.ends, strict=True)
        ), "set_ends can only rewind rows"
        self.ends = list(ends)

    def take_rows(self, idx: list[int]) -> RowKVCache:
        """A new cache holding rows `idx` (in order), trimmed to the pages they use."""
        out = RowKVCache(self.window)
        out.ends = [self.ends[i] for i in idx]
        if self.keys is not None and idx:
            width = min(self.keys.shape[2], -(-max(max(out.ends), 1) // PAGE) * PAGE)
            rows = mx.array(idx, dtype=mx.int32)
            out.keys = self.keys[rows, :, :width]
            out.values = self.values[rows, :, :width]
        return out

    @classmethod
    def merge(cls, parts: list[RowKVCache]) -> RowKVCache:
        """Concatenate caches row-wise (capacities padded to the widest)."""
        out = cls(parts[0].window)
        out.ends = [e for p in parts for e in p.ends]
        filled = [p for p in parts if p.keys is not None]
        if not filled:
            return out
        ref = filled[0]
        capacity = max(p.keys.shape[2] for p in filled)

        def padded(p: RowKVCache, which: str) -> mx.array:
            a = getattr(p, which)
            if a is None:
                shape = getattr(ref, which).shape
                return mx.zeros(
                    (len(p.ends), shape[1], capacity, shape[3]), getattr(ref, which).dtype
                )
            if a.shape[2] < capacity:
                z = mx.zeros((a.shape[0], a.shape[1], capacity - a.shape[2], a.shape[3]), a.dtype)
                a = mx.concatenate([a, z], axis=2)
            return a

        out.keys = mx.concatenate([padded(p, "keys") for p in parts], axis=0)
        out.values = mx.concatenate([padded(p, "values") for p in parts], axis=0)
        return out

    def clone(self) -> RowKVCache:
        """A snapshot: shares the (immutable) buffers, copies the ends."""
        c = RowKVCache(self.window)
        c.keys, c.values, c.ends = self.keys, self.values, list(self.ends)
        return c
