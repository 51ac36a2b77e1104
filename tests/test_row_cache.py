"""RowKVCache: each row writes at its own end; a row's attention is the same alone, in a batch,
and after rewinding and re-appending."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlx_tandem.kv.attention import KEY_SPAN
from mlx_tandem.kv.row_cache import PAGE, RowKVCache, ring_size

H, HKV, D = 4, 2, 16


def kv(rows: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((rows, HKV, n, D), key=k1), mx.random.normal((rows, HKV, n, D), key=k2)


def step(cache: RowKVCache, keys: mx.array, values: mx.array, q: mx.array) -> mx.array:
    valid = cache.make_mask(keys.shape[2])
    k, v = cache.update_and_fetch(keys, values)
    return cache.attend(q, k, v, scale=0.25, mask=valid)


def filled(lens: list[int]) -> RowKVCache:
    rows = [RowKVCache() for _ in lens]
    for i, (c, n) in enumerate(zip(rows, lens, strict=True)):
        c.ends = [0]
        c.update_and_fetch(*kv(1, n, seed=i))
    return RowKVCache.merge(rows)


def test_ragged_rows_write_at_their_own_ends():
    cache = filled([3, 7])
    keys, values = kv(2, 2, seed=9)
    k, _ = cache.update_and_fetch(keys, values)
    assert cache.ends == [5, 9] and k.shape[2] % KEY_SPAN == 0 and cache.capacity % PAGE == 0
    assert mx.array_equal(k[0, :, 3:5], keys[0]).item()
    assert mx.array_equal(k[1, :, 7:9], keys[1]).item()


def test_a_row_attends_the_same_alone_in_a_batch_and_after_rewind():
    lens = [3, 40, 300]
    q = mx.random.normal((len(lens), H, 2, D), key=mx.random.key(5))
    keys, values = kv(len(lens), 2, seed=6)
    batched = filled(lens)
    out = step(batched, keys, values, q)
    for i in range(len(lens)):
        alone = batched.take_rows([i])
        alone.set_ends([lens[i]])
        again = step(alone, keys[i : i + 1], values[i : i + 1], q[i : i + 1])
        assert mx.array_equal(again, out[i : i + 1]).item(), i
    batched.set_ends(lens)  # rewind every row, append the same tokens again
    assert mx.array_equal(step(batched, keys, values, q), out).item()


def test_clone_shares_buffers_and_copies_ends():
    cache = filled([4, 9])
    snap = cache.clone()
    cache.set_ends([2, 9])
    assert snap.ends == [4, 9] and snap.kparts is cache.kparts


def test_sliding_window_masks_old_columns():
    cache = RowKVCache(window=4)
    cache.ends = [10]
    valid = cache.make_mask(1)[0, 0, 0]
    assert valid[:11].tolist() == [False] * 7 + [True] * 4 and not valid[11:].any().item()


# --- sliding layers in a ring (window + widest append) -------------------------------
WINDOW, REACH = 100, 70


def ring_cache() -> RowKVCache:
    cache = RowKVCache(WINDOW, ring=ring_size(WINDOW, REACH))
    cache.ends = [0]
    return cache


def linear_cache() -> RowKVCache:
    cache = RowKVCache(WINDOW)
    cache.ends = [0]
    return cache


def schedule(seed: int) -> list[tuple[int, int]]:
    """(append, keep) pairs: prefill chunks, then verify blocks of which `keep` stay."""
    rng = random.Random(seed)
    out = [(64, 64)] * 3
    while sum(k for _, k in out) < 700:
        n = rng.randint(1, 8)
        out.append((n, rng.randint(1, n)))
    return out


def run(cache: RowKVCache, plan: list[tuple[int, int]], seed: int) -> list[mx.array]:
    outs = []
    for j, (n, keep) in enumerate(plan):
        keys, values = kv(1, n, seed=seed * 1000 + j)
        q = mx.random.normal((1, H, n, D), key=mx.random.key(seed * 1000 + j))
        outs.append(step(cache, keys, values, q)[:, :, :keep])
        cache.set_ends([cache.ends[0] - n + keep])
    return outs


def test_a_ring_keeps_window_plus_reach_and_attends_like_every_column():
    """A sliding layer's ring holds at most ring_size columns, through wraps and rewinds of
    rejected verify tails, and its attention is that of the layout keeping every column
    (up to summation order)."""
    plan = schedule(0)
    ring, linear = ring_cache(), linear_cache()
    a, b = run(ring, plan, 0), run(linear, plan, 0)
    assert ring.ends == linear.ends and ring.ends[0] >= 700
    assert ring.capacity == ring_size(WINDOW, REACH) == 256 < linear.capacity
    for x, y in zip(a, b, strict=True):
        assert mx.allclose(x, y, rtol=1e-5, atol=1e-5).item()


def test_a_ring_without_its_slack_loses_the_window(monkeypatch):
    """Negative control: appends wider than the ring's slack (the check switched off)
    overwrite keys the block's first queries still see."""
    plan = [(200, 200)] * 4
    with pytest.raises(AssertionError, match="wider than the ring"):
        run(ring_cache(), plan, 1)
    monkeypatch.setattr(RowKVCache, "_fits", lambda self, L: True)
    a, b = run(ring_cache(), plan, 1), run(linear_cache(), plan, 1)
    assert not all(mx.allclose(x, y, rtol=1e-5, atol=1e-5).item() for x, y in zip(a, b, strict=True))


def test_ring_rows_attend_the_same_alone_and_batched():
    """Rows at different points of their rings (wrapped or not) in one batch: each row's
    output is bit-identical to the row alone."""
    lens = [5, 250, 700]
    rows = []
    for i, n in enumerate(lens):
        c = ring_cache()
        for start in range(0, n, 50):
            c.update_and_fetch(*kv(1, min(50, n - start), seed=100 * i + start))
        rows.append(c)
    batched = RowKVCache.merge(rows)
    keys, values = kv(3, 4, seed=7)
    q = mx.random.normal((3, H, 4, D), key=mx.random.key(8))
    out = step(batched, keys, values, q)
    for i in range(3):
        alone = step(rows[i], keys[i : i + 1], values[i : i + 1], q[i : i + 1])
        assert mx.array_equal(alone, out[i : i + 1]).item(), lens[i]
        taken = batched.take_rows([i])
        taken.set_ends([lens[i]])
        again = step(taken, keys[i : i + 1], values[i : i + 1], q[i : i + 1])
        assert mx.array_equal(again, out[i : i + 1]).item(), lens[i]


def test_ring_columns_and_place_rebuild_the_row():
    """The prefix cache's path: a ring's columns of its last chunk are the positions'
    vectors, and placing positions [0, n) into a blank ring gives the buffers a row that
    appended them holds (so warm rows attend as cold rows)."""
    ring, linear = ring_cache(), linear_cache()
    for start in range(0, 640, 64):
        keys, values = kv(1, 64, seed=start)
        ring.update_and_fetch(keys, values)
        linear.update_and_fetch(keys, values)
    k, v = ring.columns(576, 640)
    assert mx.array_equal(k[0], linear.kparts[0][:, :, 576:640]).item()
    assert mx.array_equal(v[0], linear.vparts[0][:, :, 576:640]).item()
    warm = ring_cache()
    warm.place(tuple(p[:, :, :640] for p in linear.kparts),
               tuple(p[:, :, :640] for p in linear.vparts), linear.dtype)  # fmt: skip
    assert warm.ends == ring.ends and warm.capacity == ring.capacity
    for x, y in zip((*warm.kparts, *warm.vparts), (*ring.kparts, *ring.vparts), strict=True):
        assert mx.array_equal(x, y).item()


def test_committed_reads_of_a_ring_are_the_window():
    """The assistant's donor read: the valid columns of a ring hold exactly the positions
    (end - window, end), and a read wider than the ring's window is refused."""
    ring = ring_cache()
    for start in range(0, 600, 60):
        ring.update_and_fetch(*kv(1, 60, seed=start))
    keys, _, valid = ring.committed(WINDOW)
    held = ring._held(mx.array([[[599]]]), keys.shape[2])[0, 0]
    seen = sorted(p for p, ok in zip(held.tolist(), valid[0, 0, 0].tolist(), strict=True) if ok)
    assert seen == list(range(600 - WINDOW + 1, 600))
    with pytest.raises(ValueError, match="keeps only its last 100 positions"):
        ring.committed(None)


def test_a_ring_refuses_a_mask_built_for_every_column():
    """Past a wrap, a mask from an every-column cache is wider than the ring's keys: refused
    by name, never read as if its columns were the ring's."""
    ring, linear = ring_cache(), linear_cache()
    for start in range(0, 400, 50):
        keys, values = kv(1, 50, seed=start)
        ring.update_and_fetch(keys, values)
        linear.update_and_fetch(keys, values)
    keys, values = kv(1, 1, seed=1)
    q = mx.random.normal((1, H, 1, D), key=mx.random.key(2))
    wrong = linear.make_mask(1)
    k, v = ring.update_and_fetch(keys, values)
    with pytest.raises(ValueError, match="key columns"):
        ring.attend(q, k, v, scale=0.25, mask=wrong)


# --- spare rows: joins write into them, nothing else is copied ---------------------------
def one_row(n: int, seed: int) -> RowKVCache:
    c = RowKVCache()
    c.ends = [0]
    c.update_and_fetch(*kv(1, n, seed=seed))
    return c


def test_a_joining_row_fills_a_spare_row_and_attends_as_alone():
    cohort = filled([5, 9, 40, 7, 3, 12, 8, 20, 6, 4, 11, 30])
    held = cohort.kparts[0].shape[0]
    assert held == 12 + 3  # a rebuilt buffer keeps a quarter more rows spare
    stay = cohort.take_rows(list(range(8)))  # the last four leave: their rows turn spare
    assert stay.kparts is cohort.kparts
    joined = RowKVCache.merge([stay, one_row(3, seed=50)])
    assert joined.kparts[0].shape[0] == held  # written into a spare row, not rebuilt (9 + 2)
    q = mx.random.normal((9, H, 2, D), key=mx.random.key(7))
    keys, values = kv(9, 2, seed=8)
    out = step(joined, keys, values, q)
    lens = [5, 9, 40, 7, 3, 12, 8, 20, 3]
    for i, n in enumerate(lens):
        alone = one_row(n, seed=i if i < 8 else 50)
        assert mx.array_equal(step(alone, keys[i : i + 1], values[i : i + 1], q[i : i + 1]),
                              out[i : i + 1]).item(), i


def _poison_row(cache: RowKVCache, row: int) -> None:
    """NaN in every stored key and value of one buffer row."""
    nan = mx.full((1, *cache.kparts[0].shape[1:]), mx.nan)
    at = mx.array([row, 0, 0, 0])
    cache.kparts = (mx.slice_update(cache.kparts[0], nan, at, axes=(0, 1, 2, 3)),)
    cache.vparts = (mx.slice_update(cache.vparts[0], nan, at, axes=(0, 1, 2, 3)),)


def test_a_departed_rows_data_never_reaches_the_row_that_takes_its_place():
    cohort = filled([5, 300, 9])  # capacity 512 (the 300-token row)
    _poison_row(cohort, 2)  # the row that leaves held NaN
    keys, values = kv(3, 1, seed=4)
    q = mx.random.normal((3, H, 1, D), key=mx.random.key(3))
    alone = step(one_row(3, seed=60), keys[2:], values[2:], q[2:])
    # the newcomer's capacity (256) is narrower than the row it replaces
    joined = RowKVCache.merge([cohort.take_rows([0, 1]), one_row(3, seed=60)])
    assert joined.kparts[0].shape[0] == cohort.kparts[0].shape[0]  # took the spare row
    assert mx.array_equal(step(joined, keys, values, q)[2:], alone).item()
    # control: only the newcomer's own 256 columns written, the rest of the row left as it was
    narrow = cohort.take_rows([0, 1])
    narrow.ends = [5, 300, 3]
    newcomer, at = one_row(3, seed=60), mx.array([2, 0, 0, 0])
    narrow.kparts, narrow.vparts = (
        (mx.slice_update(mine[0], theirs[0], at, axes=(0, 1, 2, 3)),)
        for mine, theirs in ((narrow.kparts, newcomer.kparts), (narrow.vparts, newcomer.vparts)))
    assert mx.isnan(step(narrow, keys, values, q)[2:]).any().item()
