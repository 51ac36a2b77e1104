"""Graph binding: the seed's `AutoregressiveGraph` for any mlx-lm model.

A binding splits a model's forward into `forward_hidden` (the backbone: embeddings,
layers, final norm; writes the caches) and `project_logits` (the family's own code
after the backbone: LM head, soft-capping, logit scaling — mlx-lm's `Model.__call__`
run over a stand-in backbone that returns the hidden states it is given),
so engines compute hidden states for a whole span but project only the
positions they need (the last one, all of them, or per-row indices).

Oracle: tests/test_graph.py checks `project_logits(forward_hidden(x))` is
bit-identical to `model(x)` on tiny llama / qwen3 / gemma3 models; tests/test_families.py
on every family of models/families.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem.models.fused import LayerFusion, fuse_projections

Which = Literal["last", "all"] | mx.array


class AutoregressiveGraph(Protocol):
    """What every engine needs from a model: hidden states for a span, logits on demand."""

    vocab_size: int

    def forward_hidden(self, ids: mx.array, caches: list[Any] | None) -> mx.array:
        """Run ids (B, L) through the model, appending to caches; return hidden (B, L, D)."""
        ...

    def project_logits(self, hidden: mx.array, which: Which = "last") -> mx.array:
        """Logits (B, n, V) for the last position, all positions, or indices (B, n)."""
        ...


def select_positions(hidden: mx.array, which: Which) -> mx.array:
    if isinstance(which, mx.array):
        return mx.take_along_axis(hidden, which[..., None].astype(mx.int32), axis=1)
    if which == "last":
        return hidden[:, -1:, :]
    if which == "all":
        return hidden
    raise ValueError(f"which must be 'last', 'all' or an index array, got {which!r}")


@dataclass
class MlxLmGraph:
    """Binds an mlx-lm `Model` to the graph contract: its backbone and everything after it."""

    model: nn.Module
    head: Callable[[mx.array], mx.array]
    vocab_size: int
    backbone: nn.Module
    embedding: nn.Module  # the token embedding (its dtype is the hidden states' dtype)
    fused: tuple[LayerFusion, ...] | None = None  # stacked projections (models/fused.py)

    def forward_hidden(self, ids: mx.array, caches: list[Any] | None) -> mx.array:
        return self.backbone(ids, cache=caches)

    def project_logits(self, hidden: mx.array, which: Which = "last") -> mx.array:
        return self.head(select_positions(hidden, which))

    def make_cache(self) -> list[Any]:
        return (
            self.model.make_cache()
            if hasattr(self.model, "make_cache")
            else [_kv_cache() for _ in self.model.layers]
        )


def _kv_cache() -> Any:
    from mlx_lm.models.cache import KVCache

    return KVCache()


def is_tied(model: nn.Module) -> bool:
    tied = getattr(model, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    return bool(tied) or not hasattr(model, "lm_head")


def backbone_path(model: nn.Module) -> tuple[str, ...]:
    """Where the backbone sits: `model` (most families), `backbone` (Mamba 2, Nemotron-H),
    `language_model.model` (multimodal wrappers: Qwen 3.5, Mistral 3). Empty if none."""
    children = model if isinstance(model, nn.Module) else {}
    inner = children.get("language_model")
    if isinstance(inner, nn.Module) and isinstance(inner.get("model"), nn.Module):
        return ("language_model", "model")
    for name in ("model", "backbone"):
        if isinstance(children.get(name), nn.Module):
            return (name,)
    return ()


def _embedding(backbone: nn.Module) -> nn.Module | None:
    for name in ("embed_tokens", "embeddings"):
        if isinstance(getattr(backbone, name, None), nn.Module):
            return getattr(backbone, name)
    return None


def _after_backbone(model: nn.Module, path: tuple[str, ...]) -> Callable[[mx.array], mx.array]:
    """The model's own `__call__` with its backbone replaced by the identity: whatever the
    family does after the backbone (LM head, soft-capping, logit scaling) runs as mlx-lm
    wrote it. The stand-in is a copy of the backbone (its embedding stays reachable for
    tied heads) whose call returns the hidden states it is given; nothing is mutated."""

    def replaced(module: nn.Module, rest: tuple[str, ...]) -> nn.Module:
        out = copy.copy(module)
        child = module[rest[0]]
        if len(rest) > 1:
            out[rest[0]] = replaced(child, rest[1:])
        else:
            stand_in = copy.copy(child)
            stand_in.__class__ = type(type(child).__name__, (type(child),), {"__call__": _given})
            out[rest[0]] = stand_in
        return out

    head_model = replaced(model, path)

    def head(hidden: mx.array) -> mx.array:
        return head_model(hidden)

    return head


def _given(self: nn.Module, hidden: mx.array, *args: Any, **kwargs: Any) -> mx.array:
    return hidden


def bind_graph(model: nn.Module, fuse: bool = False) -> MlxLmGraph:
    """Bind an mlx-lm model; raises ValueError for a model whose backbone cannot be found.
    `fuse`: stack its projections for the plain compiled step (models/fused.py), rebinding
    their weights to views: the loaded model's binding only (a copy of the module tree made
    later shares the views; one made earlier would keep the separate arrays alive)."""
    path = backbone_path(model)
    backbone: Any = model
    for name in path:
        backbone = backbone[name]
    embedding = _embedding(backbone) if path else None
    if embedding is None:
        raise ValueError(
            f"model type {getattr(model, 'model_type', type(model).__name__)!r} has no "
            "`.model` / `.backbone` backbone with a token embedding; mlx-tandem cannot split "
            "its forward"
        )
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab is None:
        vocab = embedding.weight.shape[0]
    return MlxLmGraph(
        model=model,
        head=_after_backbone(model, path),
        vocab_size=int(vocab),
        backbone=backbone,
        embedding=embedding,
        fused=fuse_projections(backbone) if fuse else None,
    )
