"""The rows engine's attention hook: per-copy, verified by a probe, never process-wide."""

import importlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import gpt_oss

from mlx_tandem.kv.routing import attention_route, route_attention
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.kv.state_rows import StateRows, probe_routing, rows_model
from mlx_tandem.models.invariance import row_stable
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model

from conftest import TINY_ARCHS

ATTENTION_LAYERS = {
    "llama": [0, 1, 2, 3],
    "qwen3": [0, 1, 2, 3],
    "gemma3_text": [0, 1, 2, 3],
    "gemma4_text": [0, 1, 2, 3],
    "lfm2": [1, 3],  # layers 0 and 2 are short convolutions
}
IDS = mx.array([[5, 17, 99, 3, 250, 42]])


def _model_modules(arch: str) -> list:
    return [importlib.import_module(f"mlx_lm.models.{arch}"), mlx_lm_base]


def _unpatched(arch: str) -> bool:
    return all(
        m.scaled_dot_product_attention is mlx_lm_base.scaled_dot_product_attention
        for m in _model_modules(arch)
    )


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_attention_layer_routes_and_mlx_lm_is_untouched(tiny_model, arch):
    m = tiny_model(arch)
    before = m.model(IDS)
    classes = {name: type(mod) for name, mod in m.model.named_modules()}
    stable, _ = row_stable(m.model)
    calls = probe_routing(stable)
    assert calls == {f"model.layers.{i}.self_attn": 1 for i in ATTENTION_LAYERS[arch]}
    # the copy's attention layers run the row caches' attention on real rows too
    rows = StateRows.blank(m.model, 2)
    mx.eval(stable.model(mx.concatenate([IDS, IDS]), cache=rows.layers))
    assert probe_routing(stable) == calls
    # nothing outside the copy changed: module globals, the original's classes, its output
    assert _unpatched(arch)
    assert {name: type(mod) for name, mod in m.model.named_modules()} == classes
    assert all(attention_route(mod) is None for _, mod in m.model.named_modules())
    assert mx.array_equal(m.model(IDS), before).item()


def test_row_caches_attend_through_the_route_in_the_copy(tiny_model):
    m = tiny_model("llama")
    routed = rows_model(m.model)
    attends = []

    class Counting(RowKVCache):
        def attend(self, queries, keys, values, scale, mask, block=False):
            attends.append(queries.shape)
            return super().attend(queries, keys, values, scale, mask, block)

    caches = [Counting() for _ in m.model.layers]
    for c in caches:
        c.ends = [0]
    mx.eval(routed(IDS, cache=caches))
    assert len(attends) == len(m.model.layers)


class OwnAttention(nn.Module):
    """Llama attention that calls mx.fast directly instead of mlx-lm's shared function."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        a = self.inner
        B, L, _ = x.shape
        q = a.q_proj(x).reshape(B, L, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=a.scale, mask=mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_a_layer_computing_attention_its_own_way_is_refused_by_name(tmp_path: Path):
    m = load_folder(make_tiny_model("llama", tmp_path), name="own-attention")
    block = m.model.model.layers[3]
    block.self_attn = OwnAttention(block.self_attn)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn computes attention"):
        row_stable(m.model)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn"):
        rows_model(m.model)
    assert _unpatched("llama")


def test_attention_sinks_reach_the_row_caches_attention():
    args = gpt_oss.ModelArgs(
        num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1, vocab_size=64,
        hidden_size=32, intermediate_size=32, head_dim=16, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    )
    model = gpt_oss.Model(args)
    for layer in model.model.layers:
        layer.self_attn.sinks = mx.array([1.5, -2.0])
    ids = mx.array([[3, 9, 27, 12, 5]])
    reference = model(ids)
    routed = rows_model(model)  # the probe passes: every layer routes, sinks included
    got = routed(ids, cache=StateRows.blank(model, 1).layers)
    assert mx.allclose(got, reference, atol=1e-5).item()
    for layer in model.model.layers:  # the sinks matter: without them mlx-lm differs
        layer.self_attn.sinks = mx.zeros((2,))
    assert not mx.allclose(model(ids), reference, atol=1e-3).item()
    assert gpt_oss.scaled_dot_product_attention is mlx_lm_base.scaled_dot_product_attention


def test_the_copy_refuses_caches_without_attend(tiny_model):
    m = tiny_model("qwen3")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn got a NoneType cache"):
        route_attention(m.model)(IDS)
