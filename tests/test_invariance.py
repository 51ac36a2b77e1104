"""Batch-invariant arithmetic: the probe, the attention kernel, and that padding is needed."""

import mlx.core as mx
import pytest

from mlx_tandem.kv.attention import attention_mismatches, stable_query_rows
from mlx_tandem.models.invariance import PROBE_ROWS, probe_min_rows


def test_probe_finds_a_row_count_from_which_rows_are_stable(tiny_model):
    m = tiny_model("llama")
    layer = m.model.model.layers[0].self_attn.k_proj
    need = probe_min_rows(layer, layer.weight.shape[1])
    x = mx.random.normal((256, layer.weight.shape[1]), key=mx.random.key(1))
    ref = layer(x)
    for rows in [r for r in PROBE_ROWS if r >= need]:
        assert mx.array_equal(layer(x[:rows]), ref[:rows]).item()


def _attend_alone_vs_batched(lens, L, H=9, Hkv=3, D=64):
    return attention_mismatches(stable_query_rows(D, H, Hkv, "mlx.core.float32"), lens, L, H, Hkv, D)


@pytest.mark.parametrize("L", [1, 4, 9])
def test_invariant_attention_alone_equals_batched(L):
    assert _attend_alone_vs_batched([70, 300, 129, 1000, 64, 511, 2000, 3], L) == 0


def test_plain_sdpa_is_not_invariant_here():
    """The reason invariant_attention exists: mlx's fused SDPA changes with the batch shape.
    (If this starts passing on some BLAS, the padding is merely unnecessary, not wrong.)"""
    mx.random.seed(3)
    H, D, lens = 4, 64, [7, 13, 100, 64]
    S = max(lens)
    q = mx.random.normal((4, H, 1, D))
    k = mx.random.normal((4, 2, S, D))
    v = mx.random.normal((4, 2, S, D))
    mask = (mx.arange(S)[None] < mx.array(lens)[:, None])[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    alone = [
        mx.fast.scaled_dot_product_attention(
            q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale=0.125
        )
        for i, n in enumerate(lens)
    ]
    same = [mx.array_equal(a, out[i : i + 1]).item() for i, a in enumerate(alone)]
    if all(same):
        pytest.skip("this BLAS happens to be shape-stable for SDPA")
    assert not all(same)


def test_query_padding_probe_is_needed_at_one_row():
    """One query row per kv head is not shape-stable here; the probe pads to more."""
    assert stable_query_rows(64, 9, 3, "mlx.core.float32") > 1 or attention_mismatches(
        1, [70, 300, 1000], 9, 9, 3, 64) == 0
