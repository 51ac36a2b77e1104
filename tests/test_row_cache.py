"""RowKVCache: each row writes at its own end; a row's attention is the same alone, in a batch,
and after rewinding and re-appending."""

from __future__ import annotations

import mlx.core as mx

from mlx_tandem.kv.row_cache import PAGE, RowKVCache

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
    assert cache.ends == [5, 9] and k.shape[2] % 256 == 0 and cache.capacity % PAGE == 0
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
