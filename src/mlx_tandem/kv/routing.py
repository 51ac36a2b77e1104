"""Per-layer attention routing for the rows engine's model copy (no process-wide patch).

mlx-lm's attention modules call `scaled_dot_product_attention(q, k, v, cache=...,
scale=..., mask=...)`, a global of their model file bound to
`mlx_lm.models.base.scaled_dot_product_attention`. `route_attention(model)`
returns a structural copy of the model (sharing every array) in which each such
module gets its own subclass whose `__call__` is the same code over a globals
dict where that name is the layer's `AttentionRoute`. The route binds the
arguments by name and hands them to `cache.attend`. Nothing process-wide
changes: mlx-lm's modules, their classes and the original model are untouched,
so the plain path stays bit-identical to mlx-lm. A module whose attention is
written out inline (Gemma 2's soft-capped scores) gets its `ADAPTERS` call instead:
mlx-lm's projections, RoPE and cache update, then the route. Whether every
attention layer really routes is checked by a probe forward (kv/state_rows.rows_model).
Recurrent modules (kv/recurrent.py) get their `stepwise_class` in the same copy: outside
a row's own prefill chunk they run one token at a time and keep per-token checkpoints.
The two pieces, `copy_tree` (the structural copy) and `with_globals` (a subclass whose
`__call__` reads other globals), also build models/activations.py's copy.

Oracle: tests/test_attention_routing.py (every layer routes, a layer that does
not is refused by name, mlx-lm untouched).
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models import gemma2 as mlx_lm_gemma2

from mlx_tandem.kv.attention import BlockMode
from mlx_tandem.kv.recurrent import is_recurrent_module, stepwise_class

SDPA_NAME = "scaled_dot_product_attention"
_SDPA = mlx_lm_base.scaled_dot_product_attention
_SDPA_SIGNATURE = inspect.signature(_SDPA)


class AttentionRoute:
    """One attention layer's `scaled_dot_product_attention` in the rows engine's model copy.

    Arguments are bound by name against mlx-lm's signature, so positional and
    keyword call styles read the same `cache`, `scale`, `mask` and `sinks` (attention
    sinks, gpt_oss: handed to the row cache's attention).
    """

    def __init__(self, layer: str, block: BlockMode) -> None:
        self.layer = layer
        self.block = block
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        extra = {} if a["sinks"] is None else {"sinks": a["sinks"]}
        return self.attend(a["queries"], a["keys"], a["values"], a["cache"], a["scale"],
                           a["mask"], **extra)

    def attend(self, queries, keys, values, cache, scale, mask, **extra: Any) -> mx.array:
        """The row cache's attention (`sinks`, `softcap` passed on only when given)."""
        self.calls += 1
        attend = getattr(cache, "attend", None)
        if attend is None:  # the copy runs only on row caches; anything else would be inexact
            raise ValueError(
                f"{self.layer} got a {type(cache).__name__} cache; the rows engine's model "
                "copy runs only on row caches"
            )
        return attend(queries, keys, values, scale=scale, mask=mask, block=self.block.on, **extra)


def _gemma2_attention(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """mlx-lm's gemma2 `Attention.__call__` (0.32), whose soft-capped attention is written
    out inline rather than through scaled_dot_product_attention: the same projections,
    RoPE and cache update, then the soft-capped attention through the layer's route.
    tests/test_families.py checks the rows engine's logits equal the model's."""
    route = type(self).__dict__["attention_route"]
    if not hasattr(cache, "attend"):
        return route.attend(None, None, None, cache, self.scale, mask)  # refuses by name
    B, L, _ = x.shape
    queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = route.attend(
        queries, keys, values, cache, self.scale, mask, softcap=self.attn_logit_softcapping
    )
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


# attention modules that compute attention inline: their call, routed (by exact class)
ADAPTERS: dict[type, Callable[..., mx.array]] = {mlx_lm_gemma2.Attention: _gemma2_attention}


def _routes_through_sdpa(fn: object) -> bool:
    """Whether fn's own code reads mlx-lm's attention function as a global name."""
    return (
        isinstance(fn, types.FunctionType)
        and SDPA_NAME in fn.__code__.co_names
        and fn.__globals__.get(SDPA_NAME) is _SDPA
    )


def with_globals(cls: type, names: dict[str, Any], **attrs: Any) -> type:
    """A subclass of cls (same name) whose `__call__` is cls's code over its globals with
    `names` replaced, and with `attrs` as class attributes. Nothing else changes."""
    fn = cls.__call__
    call = types.FunctionType(
        fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    call.__kwdefaults__ = fn.__kwdefaults__
    call.__qualname__ = fn.__qualname__
    return type(
        cls.__name__,
        (cls,),
        {"__call__": call, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
         **attrs},
    )


def _routed_class(cls: type, route: AttentionRoute) -> type:
    """A subclass of cls whose `__call__` resolves the attention function to `route`."""
    return with_globals(cls, {SDPA_NAME: route}, attention_route=route)


def attention_route(module: nn.Module) -> AttentionRoute | None:
    """The route of a module of a `route_attention` copy (None for every other module)."""
    return type(module).__dict__.get("attention_route")


def copy_tree(model: nn.Module, swap: Callable[[nn.Module, str], type | None]) -> nn.Module:
    """A structural copy of `model`: every module shallow-copied (arrays shared; children
    replaced in the copy, never mutated in `model`), and given the class `swap(module,
    path)` returns where it returns one."""

    def rebuild(module: nn.Module, path: str) -> nn.Module:
        out = copy.copy(module)
        cls = swap(module, path)
        if cls is not None:
            out.__class__ = cls
        for key, value in module.items():
            where = f"{path}.{key}" if path else key
            if isinstance(value, nn.Module):
                out[key] = rebuild(value, where)
            elif isinstance(value, list) and any(isinstance(v, nn.Module) for v in value):
                out[key] = [
                    rebuild(v, f"{where}.{i}") if isinstance(v, nn.Module) else v
                    for i, v in enumerate(value)
                ]
        return out

    return rebuild(model, "")


def route_attention(model: nn.Module, block: BlockMode | None = None) -> nn.Module:
    """A structural copy of `model` (`copy_tree`) whose attention modules call their
    cache's `attend`: a module whose class's `__call__` reads mlx-lm's
    `scaled_dot_product_attention` gets a per-layer routed subclass. Modules that compute
    attention any other way are left as they are: the probe forward in
    `kv.state_rows.rows_model` finds and refuses them.
    """

    block = block or BlockMode()

    def routed(module: nn.Module, path: str) -> type | None:
        cls = type(module)
        if _routes_through_sdpa(cls.__call__):
            return _routed_class(cls, AttentionRoute(path, block))
        if cls in ADAPTERS:
            return type(
                cls.__name__,
                (cls,),
                {"__call__": ADAPTERS[cls], "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__, "attention_route": AttentionRoute(path, block)},
            )
        if is_recurrent_module(module):  # single-token arithmetic, per-token checkpoints
            return stepwise_class(cls, block)
        return None

    return copy_tree(model, routed)
