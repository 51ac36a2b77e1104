"""Recurrent layers in the rows engine: single-token arithmetic and per-token checkpoints.

A recurrent layer (short convolution, Gated DeltaNet, Mamba 2) keeps its state in
mlx-lm's `ArraysCache`; it cannot be rewound by moving a row's end. Plain decoding
feeds it one token per step, and mlx-lm computes a multi-token block with other
arithmetic (a longer convolution, Mamba's chunked SSD form), so a verify block must
not use it. In the rows engine's model copy (kv/routing.route_attention) each
recurrent module gets a `StepwiseLayer` subclass: outside prefill (a row's own
chunk, `BlockMode.on`; prompts prefilled together, `BlockMode.recurrence`) a call
over L tokens runs mlx-lm's own `__call__` one token at a time — plain decoding's
arithmetic; a ragged row's padding is masked and its per-token length is 1 or -1,
so length-aware layers (Falcon-H1's SSM) index their one-token chunk — and records
on the cache its state before the block and after each token (`Checkpoints`, an
attribute of that `ArraysCache`; any row operation builds new caches, which have
none). Prefill keeps mlx-lm's block form: plain and speculative runs share it, and
it is never rewound.

`rewind(cache, drop)` moves row i back by drop[i] of the tokens it fed: it takes
the row's checkpoint (one gather per state array), so after verification each row
resumes from the state after its own last accepted token. StateRows.set_ends calls
it (a ragged forward's padding is trimmed from attention only: `padding=True`).
Checkpoints live until the layer's next call (at most k+2 states per layer; those
past every row's position are dropped at each rewind). `unrewindable(leaves)` names
the recurrent caches a traced forward left without checkpoints (a layer this module
does not wrap): engine/runner refuses speculation for them.

Oracle: tests/test_hybrid_spec.py (greedy speculation == plain on qwen3_5,
qwen3_next, lfm2, nemotron_h and falcon_h1 targets; with the checkpoint restore
disabled it fails).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import falcon_h1, lfm2, nemotron_h, qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache

from mlx_tandem.kv.attention import BlockMode

CHECKPOINTS = "tandem_checkpoints"  # the ArraysCache attribute holding its Checkpoints

# mlx-lm's recurrent modules: each is called with (input, mask, cache) and owns one ArraysCache
RECURRENT_MODULES: tuple[type, ...] = (
    lfm2.ShortConv,
    qwen3_next.Qwen3NextGatedDeltaNet,
    qwen3_5.GatedDeltaNet,
    nemotron_h.NemotronHMamba2Mixer,
    falcon_h1.FalconH1Mixer,
)

State = list[mx.array | None]


@dataclass
class Checkpoints:
    """A recurrent cache's states during its last forward: states[j] after j of its tokens
    (a ragged row's padding is masked: its state stays); pos[i]: which of them row i holds
    now (first: the tokens it fed)."""

    states: list[State]
    pos: list[int] = field(default_factory=list)


class StepwiseLayer:
    """The wrapper one recurrent module class gets in the rows engine's model copy."""

    def __init__(self, cls: type, block: BlockMode) -> None:
        self.call: Callable[..., mx.array] = cls.__call__
        self.signature = inspect.signature(cls.__call__)
        params = list(self.signature.parameters)
        assert "cache" in params and "mask" in params, f"{cls.__name__} is not a recurrent layer"
        self.input = params[1]  # the first argument after self
        self.block = block

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> mx.array:
        bound = self.signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        x, mask, cache = a[self.input], a["mask"], a["cache"]
        if not isinstance(cache, ArraysCache):
            return self.call(*bound.args, **bound.kwargs)
        if self.block.on or self.block.recurrence:  # prefill: block form, never rewound
            setattr(cache, CHECKPOINTS, None)
            return self.call(*bound.args, **bound.kwargs)
        L = x.shape[1]
        lengths = cache.lengths  # ragged rows (ModelRunner.forward): tokens each row feeds
        fed = [L] * x.shape[0] if lengths is None else [min(L, n) for n in lengths.tolist()]
        states = [list(cache.cache)]
        outs = []
        for t in range(L):
            a[self.input] = x[:, t : t + 1]
            a["mask"] = None if mask is None else mask[:, t : t + 1]
            if lengths is not None:  # this token: 1 = fed, -1 = padding (state kept)
                cache.lengths = mx.where(lengths > t, 1, -1)
            outs.append(self.call(*bound.args, **bound.kwargs))
            states.append(list(cache.cache))
        if lengths is not None:
            cache.lengths = lengths - L  # as mlx-lm's block call leaves it
        setattr(cache, CHECKPOINTS, Checkpoints(states, fed))
        return outs[0] if L == 1 else mx.concatenate(outs, axis=1)


def stepwise_class(cls: type, block: BlockMode) -> type:
    """A subclass of mlx-lm's recurrent module `cls` whose calls go through StepwiseLayer."""
    layer = StepwiseLayer(cls, block)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> mx.array:
        return layer(self, *args, **kwargs)

    return type(
        cls.__name__,
        (cls,),
        {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
         "stepwise_layer": layer},
    )


def is_recurrent_module(module: nn.Module) -> bool:
    return type(module) in RECURRENT_MODULES


def _state_at(cp: Checkpoints, j: int, index: int) -> mx.array | None:
    state = cp.states[index][j]
    if state is None:  # the row had no state yet: mlx-lm starts from zeros
        final = cp.states[-1][j]
        return None if final is None else mx.zeros_like(final)
    return state


def rewind(cache: ArraysCache, drop: list[int]) -> None:
    """Move row i of `cache` back by drop[i] of the tokens its last forward fed."""
    if not any(drop):
        return
    cp: Checkpoints | None = getattr(cache, CHECKPOINTS, None)
    if cp is None:
        raise ValueError(
            "a recurrent layer cannot rewind: its last forward kept no per-token checkpoints"
        )
    index = [p - d for p, d in zip(cp.pos, drop, strict=True)]
    assert all(0 <= i < len(cp.states) for i in index), f"rewind past the block: {index}"
    for j in range(len(cache.cache)):
        if len(set(index)) == 1:
            cache.cache[j] = _state_at(cp, j, index[0])
            continue
        parts = [_state_at(cp, j, i) for i in index]
        if all(p is not None for p in parts):
            cache.cache[j] = mx.concatenate([p[r : r + 1] for r, p in enumerate(parts)])
    cp.pos = index
    del cp.states[max(index) + 1 :]  # rows only move back (set_ends): later states are dead


def unrewindable(leaves: list[Any]) -> list[int]:
    """Positions (among `leaves`) of recurrent caches without checkpoints after a forward."""
    return [
        n for n, c in enumerate(leaves)
        if isinstance(c, ArraysCache) and getattr(c, CHECKPOINTS, None) is None
    ]  # fmt: skip
