"""Compiled decode step, for the plain path and the rows engine's decode and verify forwards.

A decode step is split at each layer's cache write + attention (whose shapes grow
every step, so they stay eager, run by mlx-lm's own cache and SDPA code); everything
between two attentions (o-projection, residuals, norms, MLP, the next layer's
norm, q/k/v projections and RoPE) has fixed shapes for a given (rows, tokens) and runs
as one `mx.compile`d segment. Same primitives, same order: compiling only fuses the
element-wise ones, and the tests check the result is bit-identical to mlx-lm. The plain
step makes one product for a layer's q/k/v and one for its gate/up where the model's
projections are stacked (models/fused.py: probed to give each output its own product's
bits), which saves BLAS's per-call cost three times a layer.

Families with a known layer layout only (mlx-lm's llama and gemma3_text) and mlx-lm's
own KV caches; anything else gets `None` and the caller keeps the eager step. The
segments hold the model's weights as traced constants: build one per generation.

With a `block` (kv/attention.BlockMode), the rows engine's form (engine/runner.py): the
row-stable model copy, its row caches (kv/row_cache.RowKVCache, per-row offsets) and
their batch-invariant `attend` between the segments; it returns the final hidden
(B, L, D) and leaves the head to the runner. The segments trace the planned projections
as they run outside a row's own prefill chunk: every decode and verify forward (not
prefill). A ragged verify block (rows drafting different depths) runs a second set of
segments that take the real slots' indices (kv/attention.Ragged) as inputs, set on the
block while they trace, so the projections run the real slots only, as in the eager
forward. One trace per (B, L) and, ragged, per count of real slots; a set holds at most
TRACED_SHAPES of them (mx.compile keeps every trace while its function lives), then is
compiled anew.

Oracle: tests/test_generate_parity.py (compiled vs eager vs mlx-lm `generate_step`,
tokens and logprobs bit-identical on tiny llama / gemma3), tests/test_real_models.py::
test_plain_path_is_bit_identical_to_mlx_lm (real SmolLM2); for rows,
tests/test_engine.py::test_compiled_rows_decode_equals_the_eager_forward and
::test_compiled_verify_blocks_equal_the_eager_forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_tandem.kv.attention import BlockMode, Ragged
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.models.fused import LayerFusion, Stack
from mlx_tandem.models.graph import MlxLmGraph

Segment = Callable[..., Any]
TRACED_SHAPES = 64  # traces kept per segment set (~1.3 MB each for SmolLM2); then rebuilt


def _qkv(
    attn: nn.Module, x: mx.array, norms: bool, stack: Stack | None
) -> tuple[mx.array, mx.array, mx.array]:
    B, L, _ = x.shape
    q, k, v = stack(x) if stack else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
    q = q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if norms:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q, k, v


def _pre(
    layer: nn.Module, x: mx.array, offset: mx.array, norms: bool, fusion: LayerFusion
) -> tuple[mx.array, ...]:
    attn = layer.self_attn
    q, k, v = _qkv(attn, layer.input_layernorm(x), norms, fusion.qkv)
    return x, attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def _post_llama(layer: nn.Module, x: mx.array, o: mx.array, fusion: LayerFusion) -> mx.array:
    B, L, _ = x.shape
    h = x + layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    y, mlp = layer.post_attention_layernorm(h), layer.mlp
    if fusion.gate_up is None:
        return h + mlp(y)
    gate, up = fusion.gate_up(y)
    return h + mlp.down_proj(swiglu(gate, up))  # llama.MLP's expression


def _post_gemma3(layer: nn.Module, x: mx.array, o: mx.array, fusion: LayerFusion) -> mx.array:
    B, L, _ = x.shape
    r = layer.self_attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    h = gemma3_text.clip_residual(x, layer.post_attention_layernorm(r))
    y, mlp = layer.pre_feedforward_layernorm(h), layer.mlp
    if fusion.gate_up is None:
        r = mlp(y)
    else:
        gate, up = fusion.gate_up(y)
        r = mlp.down_proj(nn.gelu_approx(gate) * up)  # gemma3_text.MLP's expression
    return gemma3_text.clip_residual(h, layer.post_feedforward_layernorm(r))


class CompiledStep:
    """`step(ids (1, 1), caches) -> logits (1, V)`: one token through the model; with
    `block` (the rows engine's), `step(ids (B, L), row caches, ragged) -> hidden (B, L, D)`."""

    def __init__(
        self, graph: MlxLmGraph, backbone: nn.Module, kind: str, block: BlockMode | None = None
    ):
        self.graph = graph
        self.backbone = backbone
        self.kind = kind
        self.rows = rows = block is not None
        layers = backbone.layers
        norms = kind == "gemma3"
        post = _post_gemma3 if norms else _post_llama
        # the plain step makes one product per stack; the rows engine's projections are planned
        unfused = LayerFusion(None, None)
        fused = (tuple(f.live() for f in graph.fused) if not rows and graph.fused
                 else (unfused,) * len(layers))

        def first(ids: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
            h = backbone.embed_tokens(ids)
            if norms:  # Gemma3Model scales the embeddings (same expression)
                h = h * mx.array(backbone.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
            return _pre(layers[0], h, offset, norms, fused[0])

        def between(i: int) -> Segment:
            def seg(x: mx.array, o: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
                return _pre(layers[i + 1], post(layers[i], x, o, fused[i]), offset, norms,
                            fused[i + 1])

            return seg

        def last(x: mx.array, o: mx.array) -> mx.array:
            hidden = backbone.norm(post(layers[-1], x, o, fused[-1]))
            return hidden if rows else graph.project_logits(hidden, "last")[:, -1, :]

        plain: list[Segment] = [first, *(between(i) for i in range(len(layers) - 1)), last]
        # ragged verify blocks: the same segments, the real slots' indices as inputs
        ragged = [_with_ragged(f, block) for f in plain] if block is not None else []
        self._sets = {False: _Traced(plain), True: _Traced(ragged)}

    def _masks(self, h: mx.array, caches: list[Any]) -> list[Any]:
        bb = self.backbone
        if self.kind == "gemma3":
            p = bb.sliding_window_pattern
            full = create_attention_mask(h, caches[p - 1])
            local = (
                create_attention_mask(h, caches[0], window_size=bb.window_size) if p > 1 else None
            )
            return [full if i % p == p - 1 else local for i in range(len(caches))]
        full = create_attention_mask(h, caches[bb.fa_idx])
        local = (
            create_attention_mask(h, caches[bb.swa_idx], window_size=bb.sliding_window)
            if bb.swa_idx is not None
            else None
        )
        return [local if layer.use_sliding else full for layer in bb.layers]

    def __call__(self, ids: mx.array, caches: list[Any], ragged: Ragged | None = None) -> mx.array:
        offset = caches[0].offset if self.rows else mx.array(caches[0].offset, dtype=mx.int32)
        extra = () if ragged is None else (ragged.take, ragged.back)
        segments = self._sets[ragged is not None].segments(ids.shape, *(a.shape for a in extra))
        x, q, k, v = segments[0](ids, offset, *extra)
        masks = self._masks(x, caches)
        for i, (layer, cache) in enumerate(zip(self.backbone.layers, caches, strict=True)):
            keys, values = cache.update_and_fetch(k, v)
            scale = layer.self_attn.scale
            if self.rows:  # the route's call (kv/routing.py), outside a prefill chunk
                o = cache.attend(q, keys, values, scale=scale, mask=masks[i])
            else:
                o = scaled_dot_product_attention(
                    q, keys, values, cache=cache, scale=scale, mask=masks[i]
                )
            if i + 1 < len(caches):
                x, q, k, v = segments[i + 1](x, o, offset, *extra)
            else:
                return segments[-1](x, o, *extra)
        raise AssertionError("a model without layers")


class _Traced:
    """A set of compiled segments and the input shapes traced for it. mx.compile keeps
    every trace while its function lives, one per shape; a rows engine meets many shapes
    (rows x tokens, ragged: x real slots), so past TRACED_SHAPES the set is compiled anew
    (dropping its traces; re-tracing one costs ~10-15 ms here)."""

    def __init__(self, fns: list[Segment]) -> None:
        self.fns = fns
        self.shapes: set[tuple] = set()
        self.compiled = self._compile()

    def segments(self, *shapes: tuple) -> list[Segment]:
        if shapes not in self.shapes:
            if len(self.shapes) >= TRACED_SHAPES:
                self.shapes.clear()
                self.compiled = self._compile()
            self.shapes.add(shapes)
        return self.compiled

    def _compile(self) -> list[Segment]:
        # a new wrapper each time: mx.compile keys its traces by the function's identity
        return [mx.compile(lambda *a, f=f: f(*a)) for f in self.fns]


def _with_ragged(fn: Segment, block: BlockMode) -> Segment:
    """fn with two trailing inputs, a Ragged's take and back, set as the block's ragged
    slots while it traces (the planned projections read them; kv/attention.Ragged)."""

    def seg(*args: mx.array) -> Any:
        *inputs, take, back = args
        saved, block.ragged = block.ragged, Ragged(take, back, back.shape[0])
        try:
            return fn(*inputs)
        finally:
            block.ragged = saved

    return seg


def compiled_step(
    graph: MlxLmGraph, caches: list[Any], block: BlockMode | None = None
) -> CompiledStep | None:
    """A compiled decode step for this model and caches, or None if not covered
    (another family, or caches other than mlx-lm's plain and rotating KV caches, or with
    `block` than row KV caches)."""
    rows = block is not None
    backbone = graph.backbone
    layers = getattr(backbone, "layers", None)
    if not layers or len(caches) != len(layers):
        return None
    if not all(isinstance(c, RowKVCache) if rows else type(c) in (KVCache, RotatingKVCache)
               for c in caches):
        return None
    if isinstance(backbone, llama.LlamaModel) and all(
        type(layer) is llama.TransformerBlock for layer in layers
    ):
        return CompiledStep(graph, backbone, "llama", block)
    if isinstance(backbone, gemma3_text.Gemma3Model) and all(
        type(layer) is gemma3_text.TransformerBlock for layer in layers
    ):
        return CompiledStep(graph, backbone, "gemma3", block)
    return None
