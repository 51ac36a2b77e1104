"""The rows engine's vectorised MLP activations: accurate, per element, in the copy only."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import activations as mlx_lm_activations

from mlx_tandem.models import activations
from mlx_tandem.models.invariance import row_stable

GRID = mx.concatenate([mx.linspace(-120.0, 120.0, 240_001),
                       mx.random.normal((50_000,), key=mx.random.key(1)) * 4.0,
                       mx.array([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 1e4, -1e4])])


def _truth(name: str, x: np.ndarray) -> np.ndarray:
    z = x if name == "silu" else 2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-z))


@pytest.mark.parametrize("name", ["silu", "gelu_approx"])
def test_within_float32_rounding_of_the_function(name):
    """Relative error of the float64 function within float32's conditioning wherever it is
    a normal float32: e^-z's relative error grows with |z| times z's rounding (MLX's own
    silu: ~4e-6 where the logistic is tiny; gelu_approx's z reaches ~60 at x = -9, and
    MLX's 0.5 x (1 + tanh u) loses every digit there), ~0 where it is not."""
    ours = np.array(getattr(activations, name)(GRID), dtype=np.float64)
    x = np.array(GRID, dtype=np.float64)
    truth = _truth(name, x)
    normal = np.abs(truth) >= 1e-30
    bound = 1e-5 if name == "silu" else 3e-5
    assert np.max(np.abs(ours - truth)[normal] / np.abs(truth[normal])) <= bound
    assert np.all(np.abs(ours[~normal]) < 1e-30)
    if name == "silu":  # as close as MLX's own
        theirs = np.array(nn.silu(GRID), dtype=np.float64)
        near = normal & (np.abs(x) < 10)
        assert np.max(np.abs(ours - theirs)[near] / np.abs(truth[near])) <= 2e-6


def test_gated_forms_and_dtypes():
    gate = mx.random.normal((3, 5, 64), key=mx.random.key(2)) * 3
    x = mx.random.normal((3, 5, 64), key=mx.random.key(3))
    assert mx.array_equal(activations.swiglu(gate, x), activations.silu(gate) * x).item()
    assert mx.array_equal(activations.geglu(gate, x), activations.gelu_approx(gate) * x).item()
    for dtype in (mx.bfloat16, mx.float16):
        g = gate.astype(dtype)
        out = activations.silu(g)
        assert out.dtype == dtype
        assert mx.allclose(out.astype(mx.float32), nn.silu(g).astype(mx.float32),
                           rtol=1e-2, atol=1e-2).item()
    edge = activations.silu(mx.array([math.nan, math.inf, -100.0]))
    assert math.isnan(edge[0].item()) and edge[1].item() == math.inf and edge[2].item() == 0.0


def _rows_alone_equal_batched(fn) -> bool:
    rows = mx.random.normal((33, 3, 1536), key=mx.random.key(4)) * 5
    up = mx.random.normal((33, 3, 1536), key=mx.random.key(5))
    batched = {b: fn(rows[:b], up[:b]) for b in (1, 2, 5, 16, 33)}
    return all(
        mx.array_equal(fn(rows[i : i + 1, j : j + 1], up[i : i + 1, j : j + 1]),
                       out[i : i + 1, j : j + 1]).item()
        for b, out in batched.items() for i in range(0, b, 3) for j in range(3)
    )


def test_a_rows_result_does_not_depend_on_the_batch():
    assert _rows_alone_equal_batched(activations.swiglu)
    assert _rows_alone_equal_batched(activations.geglu)
    # control: the same check catches a function that reads other rows
    assert not _rows_alone_equal_batched(lambda g, x: activations.swiglu(g, x) * mx.max(g))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_rows_copy_gates_with_them_and_the_model_keeps_mlx_lm(tiny_model, arch):
    m = tiny_model(arch)
    mlp = m.model.model.layers[0].mlp
    cls = type(mlp)
    x = mx.random.normal((4, 3, mlp.gate_proj.weight.shape[1]), key=mx.random.key(6))
    before = mlp(x)
    stable, _ = row_stable(m.model)
    copy = stable.model.layers[0].mlp
    ours, theirs = ((activations.swiglu, mlx_lm_activations.swiglu) if arch == "llama"
                    else (activations.geglu, lambda g, u: nn.gelu_approx(g) * u))
    gate, up = copy.gate_proj(x), copy.up_proj(x)
    assert mx.array_equal(copy(x), copy.down_proj(ours(gate, up))).item()
    # control: with mlx-lm's activation the same projections give other bits
    assert not mx.array_equal(copy(x), copy.down_proj(theirs(gate, up))).item()
    # the model and mlx-lm's classes and functions are untouched
    assert type(mlp) is cls and mx.array_equal(mlp(x), before).item()
    assert cls.__call__.__globals__.get("swiglu", mlx_lm_activations.swiglu) is (
        mlx_lm_activations.swiglu)
    assert cls.__call__.__globals__["nn"] is nn
