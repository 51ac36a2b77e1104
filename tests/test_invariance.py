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


def test_fused_sdpa_row_changes_with_the_batch_key_width():
    """Why invariant_attention exists: mlx's fused SDPA gives a row a different result when the
    batch is wider than the row's own keys (masked), at SmolLM2's head shape (9 q / 3 kv heads,
    head dim 64) for a 4-token verification block. If this fails, this BLAS/mlx pairing is
    shape-stable for SDPA and the chunked attention is merely unnecessary here."""
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


@pytest.mark.parametrize("L", [3, 9])
def test_one_query_row_per_kv_head_is_not_shape_stable(L):
    """Without query padding a row's attention changes between a block call and one-query calls,
    so the probe must choose more than one row (the probed count itself is checked above)."""
    assert attention_mismatches(1, [70, 300, 1000], L, 9, 3, 64) > 0
    assert stable_query_rows(64, 9, 3, "mlx.core.float32") > 1
