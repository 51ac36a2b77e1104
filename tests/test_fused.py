"""Stacked projections (models/fused.py): views of one array, probed, and the plain compiled
step over them bit-identical to mlx-lm on an unfused twin of the model."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from mlx_tandem import SamplingParams
from mlx_tandem.engine.generate import decode_steps
from mlx_tandem.engine.sampling import RowSampler
from mlx_tandem.models.fused import LayerFusion, Stack, agrees

PROMPT = [258, 71, 68, 75, 75, 78, 220, 86, 78, 81, 75, 67, 30, 1, 2, 3, 4, 5, 6, 7, 8, 9]
COMPILED = ("llama", "gemma3_text")  # the families engine/compiled_step.py covers


def _address(a: mx.array) -> int:
    return np.asarray(a).ctypes.data


def _plain(graph, n=24):
    sampler = RowSampler(SamplingParams(max_tokens=n), graph.vocab_size)
    return list(decode_steps(graph, PROMPT, sampler, n))


def _same(ours, theirs) -> bool:
    return [t for t, _ in ours] == [int(t) for t, _ in theirs] and all(
        mx.array_equal(a.reshape(-1), b.reshape(-1)).item()
        for (_, a), (_, b) in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("arch", COMPILED)
def test_a_loaded_models_projections_are_views_of_their_stacks(tiny_model, arch):
    m = tiny_model(arch)
    assert m.graph.fused is not None and len(m.graph.fused) == len(m.graph.backbone.layers)
    for layer, fusion in zip(m.graph.backbone.layers, m.graph.fused, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        for stack, parts in ((fusion.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                             (fusion.gate_up, (mlp.gate_proj, mlp.up_proj))):
            assert stack is not None
            start = _address(stack.weight)
            row = stack.weight.shape[1] * stack.weight.itemsize
            for part, first in zip(parts, (0, *stack.splits), strict=True):
                assert _address(part.weight) == start + first * row  # no copy


@pytest.mark.parametrize("arch", COMPILED)
def test_the_plain_path_on_stacks_equals_mlx_lm_on_an_unfused_twin(tiny_model, arch):
    m = tiny_model(arch)
    twin, _ = load_model(m.path)  # mlx-lm's own load: separate projection arrays
    theirs = list(generate_step(mx.array(PROMPT), twin, max_tokens=24))
    assert _same(_plain(m.graph), theirs)
    # control: the compiled step reads the stacks (one of them off by a little: not the same)
    off = list(m.graph.fused)
    qkv = off[1].qkv
    off[1] = LayerFusion(dataclasses.replace(qkv, weight=qkv.weight * 1.01), off[1].gate_up)
    assert not _same(_plain(dataclasses.replace(m.graph, fused=tuple(off))), theirs)


def test_a_stack_whose_weights_were_replaced_is_not_used(tiny_model):
    m = tiny_model("llama", seed=3)
    twin, _ = load_model(m.path)
    attn = m.graph.backbone.layers[0].self_attn
    assert m.graph.fused[0].qkv.live()
    original = attn.k_proj.weight
    try:
        attn.k_proj.weight = original * 1.01  # load_weights would rebind it the same way
        twin.model.layers[0].self_attn.k_proj.weight = original * 1.01
        assert not m.graph.fused[0].qkv.live()
        theirs = list(generate_step(mx.array(PROMPT), twin, max_tokens=24))
        assert _same(_plain(m.graph), theirs)  # the stale stack would read the old k weights
    finally:
        attn.k_proj.weight = original


def test_the_probe_refuses_a_stack_a_little_off(tiny_model):
    attn = tiny_model("llama").model.model.layers[0].self_attn
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    stack = Stack(mx.concatenate(weights), (weights[0].shape[0], weights[0].shape[0]
                                            + weights[1].shape[0]))
    assert agrees(stack, weights, weights)
    nudged = mx.concatenate([stack.weight[:-1], stack.weight[-1:] * 1.001])
    assert not agrees(Stack(nudged, stack.splits), weights, weights)
