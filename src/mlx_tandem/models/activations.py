"""Vectorised MLP activations for the rows engine's model copy.

mlx-lm's MLPs gate with `swiglu` (silu(gate) * x), Gemma's with `nn.gelu_approx` (Gemma 4's
`geglu`); on MLX's CPU backend both reach a scalar `exp` / `tanh`, ~11 ns an element here:
at 16 decoding rows SmolLM2's 30 SiLUs took ~10 ms of an ~85 ms step, and a packed
prefill of 16 short prompts 0.47 s of 1.71 (0.36 s with these; docs/BENCHMARKS.md,
session 31). Here each is one
logistic, x / (1 + 2^y), with 2^y the polynomial the rows attention's softmax uses
(kv/attention.pow2): element-wise multiply-adds that `mx.compile` fuses into one vectorised
loop, within a few float32 ulp of MLX's (gelu_approx: x * sigmoid(2u) is 0.5 x (1 + tanh u)
without its cancellation for negative x).

`vectorised_activations(model)` returns a structural copy (sharing every array) in which a
module whose class's `__call__` reads one of those names as mlx-lm binds it gets a subclass
whose `__call__` is the same code over globals where the name is this module's function
(`kv/routing.with_globals`, as the attention routing does; recurrent layers keep theirs,
which the routing replaces with their stepwise form); the plain path keeps the
untouched model, so it stays bit-identical to mlx-lm. Every output element depends on its
own inputs only, so a row's bits do not depend on the batch.

Oracle: tests/test_activations.py (within float32 rounding of MLX's functions over their
whole range; the copy's MLPs use them and the model's do not; a row's output alone ==
batched, with a control that a batch-dependent function fails the same check); the rows
engine's exactness tests (tests/test_engine.py, tests/test_families.py) end to end.
"""

from __future__ import annotations

import math
import types
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations as mlx_lm_activations
from mlx_lm.models import gemma4_text

from mlx_tandem.kv.attention import LOG2E, pow2
from mlx_tandem.kv.recurrent import is_recurrent_module
from mlx_tandem.kv.routing import copy_tree, with_globals

_GELU_U = math.sqrt(2 / math.pi)
_LIMIT = 126.0  # pow2's range: past it the logistic is 1, or 0 (e^-z > 2^126), in float32


def _logistic_times(x: mx.array, z: mx.array) -> mx.array:
    """x * sigmoid(z) = x / (1 + e^-z), in float32 (x * 0 where e^-z overflows, as MLX's)."""
    y = z * -LOG2E
    out = x / (1.0 + pow2(mx.clip(y, -_LIMIT, _LIMIT)))
    return mx.where(y > _LIMIT, x * 0.0, out)


def _silu(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    return _logistic_times(x32, x32).astype(x.dtype)


def _gelu_approx(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    u = _GELU_U * (x32 + 0.044715 * x32 * x32 * x32)
    return _logistic_times(x32, 2.0 * u).astype(x.dtype)


# one trace per input shape (pow2's bit cast has no shapeless form), as masked_softmax;
# inside a compiled decode segment they are traced into the segment
silu = mx.compile(_silu)
gelu_approx = mx.compile(_gelu_approx)
swiglu = mx.compile(lambda gate, x: _silu(gate) * x)
geglu = mx.compile(lambda gate, x: _gelu_approx(gate) * x)

# a global name as mlx-lm's model files bind it -> the vectorised function
_REPLACED: dict[str, tuple[Any, Any]] = {
    "swiglu": (mlx_lm_activations.swiglu, swiglu),
    "geglu": (gemma4_text.geglu, geglu),
}
# `nn.gelu_approx` read through the module: `nn` becomes mlx.nn with this one name replaced
_NN = types.SimpleNamespace(**{**vars(nn), "gelu_approx": gelu_approx})


def _replacements(cls: type) -> dict[str, Any]:
    """The globals of cls.__call__ to replace (empty: leave the class as it is)."""
    fn = cls.__call__
    if not isinstance(fn, types.FunctionType):
        return {}
    names, found = fn.__code__.co_names, {}
    for name, (theirs, ours) in _REPLACED.items():
        if name in names and fn.__globals__.get(name) is theirs:
            found[name] = ours
    if "gelu_approx" in names and fn.__globals__.get("nn") is nn:
        found["nn"] = _NN
    return found


def vectorised_activations(model: nn.Module) -> nn.Module:
    """A structural copy of `model` whose MLPs gate with this module's functions."""

    def vectorised(module: nn.Module, path: str) -> type | None:
        # recurrent modules keep their class: the routing swaps it for its stepwise form
        names = {} if is_recurrent_module(module) else _replacements(type(module))
        return with_globals(type(module), names) if names else None

    return copy_tree(model, vectorised)
