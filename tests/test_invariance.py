"""Batch-invariant arithmetic: the projection plans, the attention grouping, and that both are needed."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tandem.kv import attention as attention_module
from mlx_tandem.kv.attention import (
    GROUP_ROW_CHOICES,
    BlockMode,
    Ragged,
    attention_mismatches,
    invariant_attention,
    masked_softmax,
    narrow_chunks_exact,
    narrowing_exact,
    stable_group_rows,
    stable_turned_rows,
)
from mlx_tandem.models.invariance import (
    MAX_WIDE,
    SMALL_TURNED,
    RowPlan,
    follow_plan,
    probe_plan,
    turned_form,
)

pytestmark = pytest.mark.machine_blas  # the regime of this BLAS at its own thread count


def _projection(tiny_model, name):
    layers = tiny_model("llama").model.model.layers[0]
    return getattr(layers.self_attn, name, None) or getattr(layers.mlp, name)


@pytest.mark.parametrize("name", ["q_proj", "k_proj", "down_proj"])
def test_a_row_gets_the_same_result_in_any_call_under_its_plan(tiny_model, name):
    layer = _projection(tiny_model, name)
    dims = layer.weight.shape[1]
    planned = follow_plan(layer, probe_plan(layer, dims), BlockMode())
    x = mx.random.normal((80, dims), key=mx.random.key(5))
    alone = [planned(x[i : i + 1]) for i in range(80)]
    for rows in (2, 3, 7, 12, 17, 33, 64, 80):
        for start in (0, 80 - rows):
            got = planned(x[start : start + rows])
            for i in range(rows):
                assert mx.array_equal(got[i : i + 1], alone[start + i]).item(), (rows, start, i)


@pytest.mark.parametrize("bias", [False, True])
def test_wide_calls_run_turned_and_each_row_keeps_its_one_row_result(bias):
    """At SmolLM2's width on this BLAS, `(W @ x.T).T` (rows on the call's other side) is exact
    for calls of up to `wide` rows, more than the plain form's chunk: whichever form a call
    takes, each row gets its one-row result. Trusting the turned form past its probed width
    is not exact."""
    layer = nn.Linear(576, 576, bias=bias)
    turned = turned_form(layer)
    plan = probe_plan(layer, 576, turned=turned)
    assert 0 < plan.chunk < 16 < plan.wide, plan  # the regime here: one turned call for 16 rows
    # calls the plain form would split run turned, and 2-3-row calls; no timing, so every
    # build plans alike
    assert plan.turned_from == plan.chunk + 1 and plan.turned_small == SMALL_TURNED
    assert [rows for rows in range(1, 40) if plan.turns(rows)] == [
        2, 3, *range(plan.chunk + 1, 40)]
    assert probe_plan(layer, 576, turned=turned) == plan
    planned = follow_plan(layer, plan, BlockMode(), turned)
    x = mx.random.normal((96, 576), key=mx.random.key(7))
    alone = mx.concatenate([layer(x[i : i + 1]) for i in range(96)])
    for rows in (1, 2, 3, 4, 5, plan.chunk, plan.chunk + 1, 16, plan.wide, plan.wide + 1, 64, 96):
        for start in (0, 96 - rows):
            assert mx.array_equal(planned(x[start : start + rows]), alone[start : start + rows]).item()
    too_wide = follow_plan(
        layer, RowPlan(chunk=plan.chunk, wide=MAX_WIDE, turned_from=1), BlockMode(), turned
    )
    assert not mx.array_equal(too_wide(x[:MAX_WIDE]), alone[:MAX_WIDE]).item()


def test_a_ragged_call_runs_real_slots_only_and_keeps_their_bits():
    """A verify block (B rows of width L, row i real for its first lengths[i] slots) runs a
    planned projection on the real slots only: each real slot gets the bits of the full
    padded call, each padding slot its row's last real result. Without the plan (one plain
    call of the real rows) a row's bits change with the call (the negative control)."""
    layer = nn.Linear(576, 576)
    turned = turned_form(layer)
    planned = follow_plan(layer, probe_plan(layer, 576, turned=turned), BlockMode(), turned)
    lengths, width = [4, 1, 1, 3, 1, 1, 2, 1, 1, 1, 4, 1, 1, 1, 1, 1] * 2, 4
    x = mx.random.normal((len(lengths), width, 576), key=mx.random.key(3))
    full = planned(x)
    ragged = Ragged.of(lengths, width)
    assert ragged is not None and ragged.take.size == sum(lengths)
    block = BlockMode(ragged=ragged)
    got = follow_plan(layer, probe_plan(layer, 576, turned=turned), block, turned)(x)
    for i, n in enumerate(lengths):
        assert mx.array_equal(got[i, :n], full[i, :n]).item(), i
        assert all(mx.array_equal(got[i, j], got[i, n - 1]).item() for j in range(n, width))
    assert Ragged.of([2, 2], 2) is None and Ragged.of([0, 2], 2) is None
    flat = x.reshape(-1, 576)
    real = layer(flat[ragged.take])  # unplanned: one call of the real rows
    assert not mx.array_equal(real, layer(flat)[ragged.take]).item()


def test_packed_calls_give_a_prompt_the_same_rows_at_every_aligned_offset():
    """Prompts prefilled together run in packed calls (of the probed sizes, zero-padded):
    a prompt laid out at any multiple of the period, among any other rows, gets the rows
    it gets alone (23 rows: one smallest call; placed: largest calls, then the smallest
    that holds the rest). Laying it out off the period is not exact (the negative control).
    Sizes past 192 rows are used here (768-row calls agree with 192-row ones)."""
    layer = nn.Linear(576, 1536, bias=False)
    plan = probe_plan(layer, 576, turned=turned_form(layer), packable=True)
    largest = max(plan.pack, default=0)
    assert len(plan.pack) > 1 and 1 < plan.period < min(plan.pack), plan
    assert all(size % plan.period == 0 for size in plan.pack), plan
    assert largest > 192, plan
    planned = follow_plan(layer, plan, BlockMode(packed=True), turned_form(layer))
    prompt = mx.random.normal((23, 576), key=mx.random.key(3))
    others = mx.random.normal((2 * largest, 576), key=mx.random.key(4))
    alone = planned(prompt)

    def placed(offset: int) -> mx.array:
        rows = mx.concatenate([others[:offset], prompt, others[offset:]])
        return planned(rows)[offset : offset + 23]

    p = plan.period
    offsets = [*range(0, 16 * p, p), *range(largest - 4 * p, largest + 4 * p, p), 2 * largest - p]
    for offset in offsets:  # every position mod 192, and spanning two calls
        assert mx.array_equal(placed(offset), alone).item(), offset
    misaligned = [placed(k * plan.period + 1) for k in range(4)]
    assert any(not mx.array_equal(m, alone).item() for m in misaligned)


def test_packing_refuses_a_large_call_that_disagrees_with_its_pieces():
    """Packed sizes past 192 rows are used only where such a call equals the 192-row calls
    of its pieces: a projection whose large calls round differently keeps 192 as its largest."""
    layer = nn.Linear(576, 576, bias=False)

    def skewed(x: mx.array) -> mx.array:
        y = layer(x)
        return y * (1 + 2**-20) if x.shape[0] > 192 else y

    assert max(probe_plan(layer, 576, packable=True).pack) > 192
    assert max(probe_plan(skewed, 576, packable=True).pack) == 192


def test_without_a_plan_a_rows_result_depends_on_the_call():
    """Why plans exist: on this BLAS one row's `x @ W.T` changes with the call's row count
    (or its position in the call) for SmolLM2-sized projections."""
    W = mx.random.normal((576, 576), key=mx.random.key(1))
    x = mx.random.normal((256, 576), key=mx.random.key(2))
    results = [(x[:m] @ W.T)[:1] for m in (1, 2, 7, 13, 48, 100, 256)]
    results += [(x[::-1] @ W.T)[-1:]]
    assert any(not mx.array_equal(r, results[0]).item() for r in results[1:])


def _attend_alone_vs_batched(lens, L, H=9, Hkv=3, D=64):
    return attention_mismatches(stable_group_rows(D, H, Hkv, "mlx.core.float32"), lens, L, H, Hkv, D)


@pytest.mark.parametrize("L", [1, 4, 9])
def test_invariant_attention_alone_equals_batched(L):
    assert _attend_alone_vs_batched([70, 300, 129, 1000, 64, 511, 2000, 3], L) == 0


@pytest.mark.parametrize("shape", [(256, 4, 1), (16, 4, 2), (64, 8, 8)])
def test_invariant_attention_alone_equals_batched_at_other_head_shapes(shape):
    D, H, Hkv = shape
    assert _attend_alone_vs_batched([70, 300, 5, 600], 5, H, Hkv, D) == 0


def test_invariant_attention_is_attention():
    k1, k2, k3 = mx.random.split(mx.random.key(3), 3)
    q, k, v = (mx.random.normal((2, 9, 5, 64), key=k1), mx.random.normal((2, 3, 300, 64), key=k2),
               mx.random.normal((2, 3, 300, 64), key=k3))
    valid = mx.broadcast_to(mx.arange(300)[None, None, None] < 290, (2, 1, 5, 300))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=valid)
    got = invariant_attention(q, k, v, 0.125, valid)
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_rows_softmax_is_softmax_with_exact_zeros_where_masked(dtype):
    """The rows attention's softmax (a polynomial exp, fused) is within a few float32 ulp of
    mlx's, gives masked columns exactly 0, and keeps a row's bits whatever else shares the
    call and however many masked columns trail it. Negative control (run by hand): without
    the final mask, masked columns get 2^-126 weights and this test fails."""
    k1, k2 = mx.random.split(mx.random.key(5))
    scores = (mx.random.normal((4, 3, 6, 320), key=k1) * 8).astype(dtype)
    ok = (mx.random.uniform(shape=(4, 1, 6, 320), key=k2) > 0.2) & (mx.arange(320) < 250)
    got = masked_softmax(scores, ok)
    want = mx.softmax(mx.where(ok, scores, -mx.inf), axis=-1, precise=True)
    assert got.dtype == dtype
    tol = 3e-7 if dtype == mx.float32 else 8e-3
    assert mx.allclose(got, want, atol=tol, rtol=tol).item()
    assert mx.all(mx.where(ok, True, got == 0)).item()
    assert mx.array_equal(masked_softmax(scores[1:2], ok[1:2]), got[1:2]).item()
    assert mx.array_equal(masked_softmax(scores[..., :256], ok[..., :256]), got[..., :256]).item()


def test_pow2_is_2_to_the_y_with_the_rounding_done_in_the_fused_loop():
    """pow2 (the rows softmax's and activations' exp) within 2 ulp of 2^y over its range, and
    bit for bit the formula with MLX's own round (half to even): the fused rounding (y + 1.5
    * 2^23 - 1.5 * 2^23) is that round, not folded away. Negative control (run by hand):
    rounding half away from zero (mx.floor(y + 0.5)) differs at the odd halves."""
    y = mx.concatenate([mx.linspace(-126.0, 126.0, 100_001), mx.arange(-126.0, 126.5, 0.5),
                        mx.random.uniform(-126, 126, (100_000,), key=mx.random.key(6))])
    got = mx.compile(attention_module.pow2)(y)
    n = mx.round(y)
    p = mx.array(attention_module._EXP2[-1], mx.float32)
    for c in reversed(attention_module._EXP2[:-1]):
        p = p * (y - n) + c
    want = p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)
    assert mx.array_equal(got, want).item()
    truth = np.exp2(np.array(y, dtype=np.float64))
    assert np.max(np.abs(np.array(got, dtype=np.float64) - truth) / truth) <= 2.5e-7


def test_fused_sdpa_row_changes_with_the_batch_key_width():
    """Why invariant_attention exists: mlx's fused SDPA gives a row a different result when the
    batch is wider than the row's own keys (masked), at SmolLM2's head shape (9 q / 3 kv heads,
    head dim 64) for a 4-token verification block."""
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    H, Hkv, D, L, lens = 9, 3, 64, 4, [7, 40, 300, 1000]
    S = max(lens)
    q = mx.random.normal((len(lens), H, L, D), key=k1)
    k = mx.random.normal((len(lens), Hkv, S, D), key=k2)
    v = mx.random.normal((len(lens), Hkv, S, D), key=k3)
    mask = (mx.arange(S)[None] < mx.array(lens)[:, None])[:, None, None, :]
    batched = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    differs = [
        not mx.array_equal(
            mx.fast.scaled_dot_product_attention(
                q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale=0.125
            ),
            batched[i : i + 1],
        ).item()
        for i, n in enumerate(lens)
    ]
    assert any(differs)


def test_the_grouping_must_be_probed():
    """Not every query-group size is exact on this BLAS, so the probe's choice matters."""
    inexact = [r for r in GROUP_ROW_CHOICES if attention_mismatches(r, [70, 300, 1000], 9, 9, 3, 64)]
    assert inexact
    assert stable_group_rows(64, 9, 3, "mlx.core.float32") not in inexact


@pytest.mark.parametrize("L", [2, 3, 5, 9])
def test_float_attention_runs_in_turned_groups_each_row_as_alone(L):
    """Float keys and values attend in turned groups (`keys @ q^T`, `v^T @ p^T`) of up to
    `stable_turned_rows` query rows, more than the as-is form's exact groups here, and
    every row's output is its one-query result. Negative control: one turned call for all
    of a (row, kv head)'s query rows (past the probed size) is not exact."""
    turned = stable_turned_rows(64, 64, "mlx.core.float32")
    assert turned > stable_group_rows(64, 9, 3, "mlx.core.float32")
    lens = [70, 300, 129, 1000, 64, 511, 2000, 3]
    assert attention_mismatches(1, lens, L, 9, 3, 64, turned_rows=turned) == 0
    if turned < L * 3:
        assert attention_mismatches(1, lens, L, 9, 3, 64, turned_rows=L * 3) > 0


def test_the_turned_groups_are_attention():
    """Turned, as it is, and mlx's fused attention agree to rounding (a turned group is a
    regrouping of the same products, not another function)."""
    k1, k2, k3 = mx.random.split(mx.random.key(8), 3)
    q, k, v = (mx.random.normal((2, 9, 3, 64), key=k1), mx.random.normal((2, 3, 200, 64), key=k2),
               mx.random.normal((2, 3, 200, 64), key=k3))
    valid = mx.broadcast_to(mx.arange(200)[None, None, None] < 190, (2, 1, 3, 200))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=valid)
    for turned in (0, stable_turned_rows(64, 64, "mlx.core.float32")):
        got = invariant_attention(q, k, v, 0.125, valid, turned_rows=turned)
        assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("W", [9, 64, 130, 256, 300, 577])
def test_a_narrowed_last_key_chunk_gives_the_whole_chunks_bits(W, monkeypatch):
    """`p v` reads only the scored keys' spans of its last chunk: bit for bit what whole,
    zero-weighted chunks give (and what the probe allows here)."""
    assert narrow_chunks_exact(64, "mlx.core.float32")
    k1, k2, k3 = mx.random.split(mx.random.key(W), 3)
    q = mx.random.normal((3, 9, 4, 64), key=k1)
    k = mx.random.normal((3, 3, W, 64), key=k2)
    v = mx.random.normal((3, 3, W + 256, 64), key=k3)  # a cache may hand wider values
    qpos = mx.array([0, W // 2, W - 4])[:, None] + mx.arange(4)[None]
    valid = (mx.arange(W)[None, None] <= qpos[:, :, None])[:, None]
    narrowed = invariant_attention(q, k, v, 0.125, valid)
    monkeypatch.setattr(attention_module, "narrow_chunks_exact", lambda *a: False)
    whole = invariant_attention(q, k, v, 0.125, valid)
    assert mx.array_equal(narrowed, whole).item()


def test_the_narrowing_probe_refuses_a_product_that_splits_k_by_its_length():
    """Negative control: a matmul summing K in two halves (a reduction whose split depends on
    the length, as a GPU's may) must keep whole chunks."""

    def halves(a: mx.array, b: mx.array) -> mx.array:
        h = a.shape[-1] // 2
        return a[..., :h] @ b[..., :h, :] + a[..., h:] @ b[..., h:, :]

    assert narrowing_exact(mx.matmul, 64, mx.float32)
    assert not narrowing_exact(halves, 64, mx.float32)


@pytest.mark.parametrize(
    "plan",
    [RowPlan(), RowPlan(pad_to=8), RowPlan(chunk=12), RowPlan(chunk=12, wide=30, turned_from=12),
     RowPlan(chunk=6, wide=30, turned_from=4), RowPlan(chunk=12, wide=30, turned_from=13,
                                                       turned_small=3)],
)
def test_as_is_says_exactly_when_a_plan_calls_the_function_as_it_is(plan):
    calls: list[tuple[str, int]] = []
    W = mx.random.normal((8, 4), key=mx.random.key(0))

    def fn(x):
        calls.append(("fn", x.shape[0]))
        return x @ W.T

    def turned(x):
        calls.append(("turned", x.shape[0]))
        return (W @ x.T).T

    planned = follow_plan(fn, plan, BlockMode(), turned)
    for rows in range(1, 40):
        calls.clear()
        planned(mx.ones((rows, 4)))
        assert plan.as_is(rows) == (calls == [("fn", rows)]), rows


def test_the_head_keeps_its_small_calls_as_they_are(tiny_model):
    """Projections run 2-3-row calls turned, the LM head as they are: turned it is no faster,
    and an as-is call lets a greedy verify read exact logits (no certified second call)."""
    from mlx_tandem.engine.runner import ModelRunner

    runner = ModelRunner(tiny_model("llama"))
    assert runner.small_turned == SMALL_TURNED
    assert runner.head_plan is not None and runner.head_plan.turned_small == 0
    assert runner.head_plan.as_is(2) and runner.head_plan.as_is(3)
