"""StateRows operations keep every row exactly as if it had been run alone."""

import mlx.core as mx
import pytest

from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.kv.state_rows import StateRows, tail_into_holes

ARCHS = ("llama", "gemma3_text", "lfm2")


def prefilled(runner, ids):
    row = runner.blank_rows(1)
    runner.prefill(row, ids, 16)
    return row


def decode(runner, rows, tokens, steps=6):
    """Greedy-decode `rows` from `tokens`; per-row lists of logits."""
    out = [[] for _ in tokens]
    ids = mx.array(tokens, dtype=mx.int32)[:, None]
    for _ in range(steps):
        logits = runner.logits(runner.forward(rows, ids))[:, -1]
        mx.eval(logits)
        for i in range(rows.row_count):
            out[i].append(logits[i])
        ids = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
    return out


def same(a, b):
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


PROMPTS = [[5, 9, 13, 200, 7], list(range(20, 70)), [3], list(range(100, 120))]


CODECS = [("llama", "turbo-k3v4"), ("gemma3_text", "turbo-k4v4,center"), ("lfm2", "turbo-k8v4")]


@pytest.fixture(params=[(a, "fp") for a in ARCHS] + CODECS, ids="-".join)
def runner(request, tiny_model):
    """Every check runs on float rows and on rows that store K/V through a KV codec."""
    arch, codec = request.param
    return ModelRunner(tiny_model(arch), kv_codec=codec)


def alone(runner, i):
    rows = runner.empty_rows()
    rows.prepare_append(
        [prefilled(runner, PROMPTS[i][:-1]) if len(PROMPTS[i]) > 1 else runner.blank_rows(1)]
    ).commit()
    return decode(runner, rows, [PROMPTS[i][-1]])[0]


def cohort(runner, idx):
    rows = runner.empty_rows()
    parts = [
        prefilled(runner, PROMPTS[i][:-1]) if len(PROMPTS[i]) > 1 else runner.blank_rows(1)
        for i in idx
    ]
    rows.prepare_append(parts).commit()
    return rows


def test_append_filter_extract_merge(runner):
    refs = [alone(runner, i) for i in range(len(PROMPTS))]
    rows = cohort(runner, [0, 1, 2, 3])
    got = decode(runner, rows, [p[-1] for p in PROMPTS])
    assert all(same(g, r) for g, r in zip(got, refs, strict=True))

    rows = cohort(runner, [0, 1, 2, 3])
    rows.filter_rows([3, 1])
    assert rows.row_count == 2
    got = decode(runner, rows, [PROMPTS[3][-1], PROMPTS[1][-1]])
    assert same(got[0], refs[3]) and same(got[1], refs[1])

    rows = cohort(runner, [0, 1, 2, 3])
    parts = [rows.extract_row(i) for i in (2, 0, 1, 3)]
    rows.merge_rows(parts)  # a permutation, as per-row restores produce
    got = decode(runner, rows, [PROMPTS[i][-1] for i in (2, 0, 1, 3)])
    assert all(same(g, refs[i]) for g, i in zip(got, (2, 0, 1, 3), strict=True))


def test_tail_into_holes_keeps_survivors_below_the_count_in_place():
    assert tail_into_holes([0, 2, 3, 5, 6]) == [0, 5, 2, 3, 6]
    assert tail_into_holes([1, 2]) == [2, 1]
    assert tail_into_holes([0, 1, 2]) == [0, 1, 2] and tail_into_holes([]) == []


def _held(rows: StateRows) -> int:
    """Buffer rows of the first row cache (spare rows included)."""
    return next(c for c in rows.leaves() if isinstance(c, RowKVCache)).kparts[0].shape[0]


def test_rows_leave_from_the_tail_and_join_into_spare_rows(runner):
    refs = [alone(runner, i) for i in range(len(PROMPTS))]
    rows = cohort(runner, [0, 1, 2, 3])
    held = _held(rows)
    order = rows.leaving_order([0, 2, 3])
    assert order == [0, 3, 2]  # row 3 moves into row 1's place, row 2 stays
    rows.filter_rows(order)
    assert _held(rows) == held  # the same buffers: only row 3 was written
    rows.prepare_append([prefilled(runner, PROMPTS[1][:-1])]).commit()
    assert _held(rows) == held  # the joining row went into a spare row
    got = decode(runner, rows, [PROMPTS[i][-1] for i in (0, 3, 2, 1)])
    assert all(same(g, refs[i]) for g, i in zip(got, (0, 3, 2, 1), strict=True))


def test_clone_is_a_snapshot(runner):
    ref = alone(runner, 1)
    rows = cohort(runner, [1])
    snap = rows.clone()
    decode(runner, rows, [PROMPTS[1][-1]], steps=3)  # the live cohort moves on
    assert same(decode(runner, snap, [PROMPTS[1][-1]])[0], ref)


def test_prepared_append_is_inert_until_commit(runner):
    ref = [alone(runner, i) for i in (0, 1)]
    rows = cohort(runner, [0, 1])
    change = rows.prepare_append([prefilled(runner, PROMPTS[3][:-1])])
    change.dispose()  # e.g. the admission failed after preparing
    assert rows.row_count == 2
    got = decode(runner, rows, [PROMPTS[0][-1], PROMPTS[1][-1]])
    assert same(got[0], ref[0]) and same(got[1], ref[1])


def test_rewinding_a_row_by_its_end_equals_never_having_appended(runner):
    """Recurrent layers included: they rewind to their per-token checkpoints."""
    ref = alone(runner, 1)
    rows = cohort(runner, [1])
    ends = rows.ends
    runner.forward(rows, mx.array([[11, 12, 13]], dtype=mx.int32))  # a rejected draft block
    rows.set_ends(ends)
    assert same(decode(runner, rows, [PROMPTS[1][-1]])[0], ref)


def test_unknown_cache_kind_is_refused():
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_tandem.kv import state_rows

    with pytest.raises(ValueError, match="QuantizedKVCache"):
        state_rows._row_kind(QuantizedKVCache())
    assert isinstance(StateRows([], 0).ends, list)
