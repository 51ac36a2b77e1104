"""The assistant (MTP) drafter's network: a few Q-only layers over the target's own K/V.

One draft step (SPEC_REFERENCE §1):
    x  = pre_projection(concat(embed_scale * target_embedding(token), h_prev))
    x  = layers(x)   # attention is Q-only: keys/values are the target's ("donor") K/V
    n  = norm(x);  h_next = post_projection(n)   (then `out_norm`, if configured)
    logits over the draft vocabulary from `head`:
      "target"   the target's own head rows for `draft_vocab` applied to h_next (a trained
                 tandem assistant: h_next lives where the target's final hidden lives —
                 after the target's final norm, which `out_norm` starts as a copy of);
      "dense"    its own head over n (Gemma 4 26B/31B: the drafter's tied embedding);
      "centroid" Gemma 4 E2B/E4B's clustered head over n (models/gemma4_assistant.py).
Each layer's attention takes its RoPE, scale and (unless it has its own) nothing else
from the target layer it reads (`DonorLayer`): the last full-attention layer for a full
layer, the last sliding-window layer for a sliding one. The network writes no K/V; all
steps of a round query one position (the row's committed length).

The attention function is injected: the rows engine passes the batch-invariant one, the
lab's training passes fused attention over whole sequences.

Oracle: tests/test_assistant.py (a step's drafts == a hand-rolled reference step; wrong
donor layer / missing head make it fail; greedy speculation with it == plain).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem.models.graph import is_tied

FULL, SLIDING = "full_attention", "sliding_attention"
HEADS = ("target", "dense", "centroid")
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

Attend = Callable[[mx.array, mx.array, mx.array, float, mx.array], mx.array]


@dataclass
class AssistantConfig:
    backbone_hidden_size: int  # the target's hidden width B
    hidden_size: int  # the drafter's width D
    intermediate_size: int
    num_attention_heads: int
    head_dim: int
    layer_types: list[str]
    global_head_dim: int = 0  # full-attention layers' query head width (0: head_dim; Gemma 4)
    model_type: str = "tandem_assistant"
    rms_norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight)
    sandwich_norms: bool = False  # Gemma: post-attention / post-MLP norms and layer_scalar
    activation: str = "silu"  # or "gelu_approx"
    q_norm: bool = False
    attention_scale: float | None = None  # None: the donor layer's scale
    embed_scale: float = 1.0  # the target's embedding scale (Gemma: sqrt(B))
    head: str = "target"
    draft_vocab_size: int = 0  # "target" / "dense": rows of the draft vocabulary
    out_norm: bool = False  # RMSNorm on h_next (backbone width): the target's final-norm space
    target: str = ""  # the target it was made for (a name, for messages)
    extra: dict[str, Any] = field(default_factory=dict)  # provenance: command, seed, data

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
        if bad or not self.layer_types:
            raise ValueError(f"assistant layer_types must be {FULL!r}/{SLIDING!r}, got {bad}")
        if self.head not in HEADS:
            raise ValueError(f"assistant head must be one of {HEADS}, got {self.head!r}")


@dataclass
class DonorLayer:
    """What a Q-only layer borrows from the target layer whose K/V it reads."""

    index: int  # the target layer
    rope: Callable[..., mx.array]
    scale: float
    window: int | None  # sliding window of that layer (None: full attention)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = mx.full((dims,), 1.0 - offset)
        self.eps, self.offset = eps, offset

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.offset + self.weight, self.eps)


class QOnlyAttention(nn.Module):
    def __init__(self, cfg: AssistantConfig, kind: str) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        if kind == FULL and cfg.global_head_dim:
            self.head_dim = cfg.global_head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.q_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.fixed_scale = cfg.attention_scale

    def __call__(self, x, keys, values, valid, donor: DonorLayer, offset, attend: Attend):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.heads, self.head_dim)
        if "q_norm" in self:
            q = self.q_norm(q)
        q = donor.rope(q.transpose(0, 2, 1, 3), offset=offset)
        scale = donor.scale if self.fixed_scale is None else self.fixed_scale
        out = attend(q, keys, values, scale, valid)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        D, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(D, inner, bias=False)
        self.up_proj = nn.Linear(D, inner, bias=False)
        self.down_proj = nn.Linear(inner, D, bias=False)
        self.act = nn.gelu_approx if cfg.activation == "gelu_approx" else nn.silu

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class AssistantLayer(nn.Module):
    def __init__(self, cfg: AssistantConfig, kind: str) -> None:
        super().__init__()
        D, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.self_attn = QOnlyAttention(cfg, kind)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(D, eps, off)
        self.post_attention_layernorm = RMSNorm(D, eps, off)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(D, eps, off)
            self.post_feedforward_layernorm = RMSNorm(D, eps, off)
            self.layer_scalar = mx.ones((1,))

    def __call__(self, x, keys, values, valid, donor, offset, attend):
        a = self.self_attn(self.input_layernorm(x), keys, values, valid, donor, offset, attend)
        if not self.sandwich:  # pre-norm (Llama)
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class Assistant(nn.Module):
    """The drafter network. `head_rows` (frozen target head rows) is bound, not trained or saved."""

    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.config = cfg
        B, D = cfg.backbone_hidden_size, cfg.hidden_size
        self.pre_projection = nn.Linear(2 * B, D, bias=False)
        self.layers = [AssistantLayer(cfg, kind) for kind in cfg.layer_types]
        self.norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_offset)
        self.post_projection = nn.Linear(D, B, bias=False)
        if cfg.out_norm:
            self.out_norm = RMSNorm(B, cfg.rms_norm_eps, cfg.norm_offset)
        if cfg.head == "dense":
            self.lm_head = nn.Linear(D, cfg.draft_vocab_size, bias=False)
        if cfg.head in ("target", "dense"):
            self.draft_vocab = mx.arange(cfg.draft_vocab_size, dtype=mx.int32)
            self.freeze(keys=["draft_vocab"], recurse=False)
        self.head_rows: mx.array | None = None  # "target": (draft_vocab_size, B), bound later
        self.centroid_head: Callable[[mx.array], tuple[mx.array, mx.array]] | None = None

    def __call__(
        self,
        embedded: mx.array,
        h_prev: mx.array,
        donors: list[tuple[mx.array, mx.array, mx.array]],
        bindings: list[DonorLayer],
        offset: mx.array | int,
        attend: Attend,
    ) -> tuple[mx.array, mx.array]:
        """(N, L, B) embeddings and hiddens -> (draft logits (N, L, Vd), h_next (N, L, B))."""
        x = self.pre_projection(mx.concatenate([embedded, h_prev], axis=-1))
        for layer, (k, v, valid), donor in zip(self.layers, donors, bindings, strict=True):
            x = layer(x, k, v, valid, donor, offset, attend)
        n = self.norm(x)
        h_next = self.post_projection(n)
        if "out_norm" in self:
            h_next = self.out_norm(h_next)
        return self.head_logits(n, h_next), h_next

    def head_logits(self, normed: mx.array, h_next: mx.array) -> mx.array:
        head = self.config.head
        if head == "target":
            if self.head_rows is None:
                raise ValueError("assistant head rows are not bound to a target")
            return h_next @ self.head_rows.T
        if head == "dense":
            return self.lm_head(normed)
        if self.centroid_head is None:
            raise ValueError("assistant centroid head is missing")
        return self.centroid_head(normed)[0]

    def bind_head_rows(self, rows: mx.array) -> None:
        """The target's head rows for the draft vocabulary (frozen: never trained or saved)."""
        self.head_rows = rows
        self.freeze(keys=["head_rows"], recurse=False)


def target_layer_windows(target: nn.Module) -> list[int | None]:
    """Per target layer that keeps K/V: its sliding window, or None for full attention.

    Read from the target's caches; KV-sharing models (Gemma 4) keep caches only for their
    first layers, which are then exactly the non-shared layers a donor may be."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    caches = target.make_cache() if hasattr(target, "make_cache") else [
        KVCache() for _ in target.layers
    ]
    if len(caches) > len(target.layers):
        raise ValueError("the assistant drafter needs at most one K/V cache per target layer")
    out: list[int | None] = []
    for c in caches:
        if type(c) is RotatingKVCache:
            out.append(c.max_size)
        elif type(c) is KVCache:
            out.append(None)
        else:
            raise ValueError(
                f"the assistant drafter reads attention K/V; target layer cache "
                f"{type(c).__name__} has none"
            )
    return out


def bind_target(assistant: Assistant, target: nn.Module) -> list[DonorLayer]:
    """Donor binding and head rows: each assistant layer reads the target's last layer of its
    type; a "target" head takes the target's head rows for the draft vocabulary."""
    windows = target_layer_windows(target)
    donors = []
    for j, kind in enumerate(assistant.config.layer_types):
        found = [i for i, w in enumerate(windows) if (w is None) == (kind == FULL)]
        if not found:
            raise ValueError(f"the target has no {kind} layer for the assistant to read")
        i = found[-1]
        attn = target.layers[i].self_attn
        width, q_width = getattr(attn, "head_dim", None), assistant.layers[j].self_attn.head_dim
        if width is not None and int(width) != q_width:
            raise ValueError(
                f"assistant layer {j} ({kind}) has {q_width}-wide query heads but target "
                f"layer {i}, whose K/V it reads, has {width}-wide heads"
            )
        donors.append(DonorLayer(i, attn.rope, float(attn.scale), windows[i]))
    if assistant.config.head == "target":
        assistant.bind_head_rows(target_head_rows(target, assistant.draft_vocab))
    return donors


def target_head_rows(target: nn.Module, ids: mx.array) -> mx.array:
    """Rows `ids` of the target's output head, dequantized (tied heads: the embedding rows)."""
    if is_tied(target):
        return target.model.embed_tokens(ids)
    head = target.lm_head
    if hasattr(head, "scales"):
        w = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
        return w[ids]
    return head.weight[ids]


def embed_tokens(target: nn.Module, ids: mx.array, scale: float) -> mx.array:
    """The target's token embedding scaled as the assistant was trained to read it."""
    e = target.model.embed_tokens(ids)
    return e * mx.array(scale, e.dtype) if scale != 1.0 else e


def save_assistant(model: Assistant, folder: Path, dtype: mx.Dtype = mx.float16) -> None:
    """config.json + model.safetensors (weights in `dtype`, the draft vocabulary as int32)."""
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v if k == "draft_vocab" else v.astype(dtype)
        for k, v in tree_flatten(model.parameters())
        if k != "head_rows"
    }
    mx.save_safetensors(str(folder / WEIGHTS_FILE), weights)
    (folder / CONFIG_FILE).write_text(json.dumps(asdict(model.config), indent=2) + "\n")


def load_tandem_assistant(folder: Path, dtype: mx.Dtype = mx.float32) -> Assistant:
    """A folder written by `save_assistant` (models/assistant_folder.py dispatches kinds)."""
    raw = json.loads((folder / CONFIG_FILE).read_text())
    model = Assistant(AssistantConfig(**raw))
    weights = mx.load(str(folder / WEIGHTS_FILE))
    weights = {k: v if k == "draft_vocab" else v.astype(dtype) for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
