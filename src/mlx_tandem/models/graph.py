"""Graph binding: the seed's `AutoregressiveGraph` for any mlx-lm model.

A binding splits a model's forward into `forward_hidden` (embeddings, layers,
final norm; writes the caches) and `project_logits` (LM head, soft-capping),
so engines compute hidden states for a whole span but project only the
positions they need (the last one, all of them, or per-row indices).

Oracle: tests/test_graph.py checks `project_logits(forward_hidden(x))` is
bit-identical to `model(x)` on tiny llama / qwen3 / gemma3 models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import mlx.core as mx
import mlx.nn as nn

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
    """Binds an mlx-lm `Model` (with `.model` backbone) to the graph contract."""

    model: nn.Module
    head: Callable[[mx.array], mx.array]
    vocab_size: int

    def forward_hidden(self, ids: mx.array, caches: list[Any] | None) -> mx.array:
        return self.model.model(ids, cache=caches)

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


def bind_graph(model: nn.Module) -> MlxLmGraph:
    """Bind an mlx-lm model; raises ValueError for model classes without a `.model` backbone."""
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(backbone, "embed_tokens"):
        raise ValueError(
            f"model type {getattr(model, 'model_type', type(model).__name__)!r} has no "
            "`.model.embed_tokens` backbone; mlx-tandem cannot split its forward"
        )
    project = backbone.embed_tokens.as_linear if is_tied(model) else model.lm_head
    cap = getattr(getattr(model, "args", None), "final_logit_softcapping", None)
    if cap:

        def head(h: mx.array) -> mx.array:
            return mx.tanh(project(h) / cap) * cap
    else:
        head = project
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab is None:
        vocab = backbone.embed_tokens.weight.shape[0]
    return MlxLmGraph(model=model, head=head, vocab_size=int(vocab))
