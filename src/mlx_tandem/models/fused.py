"""Fused projections: a layer's q/k/v weights, and its gate/up weights, as slices of one array.

A one-token step pays BLAS's per-call cost for every projection. `fuse_projections`
stacks each layer's q/k/v weights (and gate/up) into one array and rebinds every Linear's
weight to its row slice of the stack: a view, so no memory is added once the separate
arrays are freed, and every path reads the same numbers as before. Only the plain
compiled step (engine/compiled_step.py) makes the one product over a stack, and only where a
probe shows it gives every output the bits of that output's own product at one row (a
BLAS that sums each output over the input features the same way whatever the number of
outputs: OpenBLAS here; the probe checks the BLAS and device it runs on, layer by layer,
before that layer changes) and that the slices give the separate products' bits too.
Plain Linear layers without bias only; anything else keeps its projections (`None`).
A stack is used only while every Linear still holds the view it was given (`Stack.live`):
weights replaced after loading (`load_weights`) turn that layer's products back into its own.

Oracle: tests/test_fused.py (stacks are views, probed; the plain path on a fused model ==
mlx-lm on an unfused twin, bit for bit; control: a stack a little off is refused).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Stack:
    """Several projections' weights stacked by rows; `__call__` returns each one's output."""

    weight: mx.array  # (sum of the projections' outputs, input features)
    splits: tuple[int, ...]  # where each projection's outputs end, but the last
    parts: tuple[nn.Module, ...] = ()  # the Linear layers whose weights are its views
    views: tuple[mx.array, ...] = ()

    def __call__(self, x: mx.array) -> list[mx.array]:
        return mx.split(x @ self.weight.T, list(self.splits), axis=-1)

    def live(self) -> bool:
        """Whether every part still holds its view (its weight was not replaced since)."""
        return all(p.weight is v for p, v in zip(self.parts, self.views, strict=True))


@dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class LayerFusion:
    qkv: Stack | None
    gate_up: Stack | None

    def live(self) -> LayerFusion:
        """This fusion without any stack whose parts' weights were replaced since."""
        return LayerFusion(*(s if s is not None and s.live() else None
                             for s in (self.qkv, self.gate_up)))


def fuse_projections(backbone: nn.Module) -> tuple[LayerFusion, ...] | None:
    """Stack every layer's q/k/v and gate/up projections where the probe allows (rebinding
    their weights to views of the stacks); None for a backbone without such layers."""
    layers = getattr(backbone, "layers", None)
    if not layers:
        return None
    fusions = tuple(
        LayerFusion(
            _stack(_parts(layer.get("self_attn"), ("q_proj", "k_proj", "v_proj"))),
            _stack(_parts(layer.get("mlp"), ("gate_proj", "up_proj"))),
        )
        for layer in layers
    )
    return fusions if any(f.qkv or f.gate_up for f in fusions) else None


def _parts(module: nn.Module | None, names: tuple[str, ...]) -> list[nn.Module | None]:
    return [getattr(module, name, None) for name in names]


def _stack(parts: list[nn.Module | None]) -> Stack | None:
    """One layer's projections stacked and rebound to views, or None (left as they are)."""
    if not all(type(p) is nn.Linear and "bias" not in p for p in parts):
        return None
    weights = [p.weight for p in parts]
    if len({(w.shape[1], w.dtype) for w in weights}) != 1:
        return None
    ends = list(itertools.accumulate(w.shape[0] for w in weights))
    stacked = mx.concatenate(weights)
    views = tuple(stacked[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True))
    mx.eval(stacked, views)
    stack = Stack(stacked, tuple(ends[:-1]), tuple(parts), views)
    if not agrees(stack, weights, list(views)):
        return None
    for part, view in zip(parts, views, strict=True):
        part.weight = view
    return stack



def agrees(stack: Stack, weights: list[mx.array], views: list[mx.array]) -> bool:
    """Whether, at one row, the stack's product and each view's give every output the bits
    of its own weight's product (a fixed input: one array, so every output is compared)."""
    x = mx.random.normal((1, 1, weights[0].shape[1]), key=mx.random.key(0))
    x = x.astype(weights[0].dtype)
    own = [x @ w.T for w in weights]
    together = stack(x)
    return all(
        mx.array_equal(a, b).item() and mx.array_equal(a, x @ v.T).item()
        for a, b, v in zip(own, together, views, strict=True)
    )
