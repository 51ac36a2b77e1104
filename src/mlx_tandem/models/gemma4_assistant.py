"""Google's Gemma 4 assistant (MTP drafter) checkpoints in our assistant network.

Owns what is Gemma-specific about a `gemma4_assistant` folder (SPEC_REFERENCE §1):
  * the config.json -> `AssistantConfig` mapping: Gemma 4 layers (sandwich norms with
    `layer_scalar`, per-head `q_norm`, gated GELU, attention scale 1.0, plain RMSNorm
    scaling by `weight` as in mlx-lm's gemma4_text), the target embedding scaled by
    sqrt(backbone_hidden_size), full-attention layers querying with `global_head_dim`;
  * the tensor-name map onto models/assistant's `Assistant` (missing or unknown tensors
    are refused by name; the tied `lm_head.weight` is dropped);
  * the head: "dense" (26B/31B) is the drafter's tied `embed_tokens` as a linear layer;
    "centroid" (E2B/E4B, `use_ordered_embeddings`) is `CentroidHead`.
Which target layers the assistant reads (the last non-KV-shared full / sliding layer) is
models/assistant.bind_target's: it picks among the layers that hold a cache.

Oracle: tests/test_gemma4_assistant.py (the centroid head == a numpy reference; the
engine's drafts == a numpy reference step over the right donor layers; greedy speculation
with loaded checkpoints == plain; missing tensors refused).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_tandem.models.assistant import CONFIG_FILE, Assistant, AssistantConfig

MODEL_TYPE = "gemma4_assistant"
TIED_HEAD = "model.embed_tokens.weight"  # the drafter's own (vocab, D) table: its LM head
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "layer_scalar",
)
CENTROIDS, ORDERING = "masked_embedding.centroids.weight", "masked_embedding.token_ordering"


class CentroidHead(nn.Module):
    """Gemma 4 E2B/E4B's clustered LM head over the full vocabulary.

    Score the clusters with `centroids`, keep the top `top_k`, take their vocab ids from
    `token_ordering` viewed as (clusters, vocab / clusters), dot the normed hidden with
    those rows of the tied embedding and scatter into the vocabulary; every other token
    gets -inf, so sampled drafting has a real q (HF fills min(selected) - 1 instead)."""

    def __init__(self, num_centroids: int, top_k: int, vocab: int, hidden: int) -> None:
        super().__init__()
        if vocab % num_centroids or not 0 < top_k <= num_centroids:
            raise ValueError(
                f"centroid head: vocabulary {vocab} must split evenly into {num_centroids} "
                f"clusters, of which 1..{num_centroids} are kept (got {top_k})"
            )
        self.clusters, self.top_k, self.vocab = num_centroids, top_k, vocab
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        self.embedding = mx.zeros((vocab, hidden))  # the drafter's tied embed_tokens
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.freeze(keys=["token_ordering"], recurse=False)

    def __call__(self, normed: mx.array) -> tuple[mx.array, mx.array]:
        """(..., D) -> (logits (..., vocab), the selected vocab ids (..., top_k * size))."""
        scores = self.centroids(normed)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        clusters = self.token_ordering.reshape(self.clusters, -1)
        ids = clusters[top].reshape(*normed.shape[:-1], -1)
        rows = self.embedding[ids]  # (..., n, D)
        logits = (rows @ normed[..., None])[..., 0]
        full = mx.full((*normed.shape[:-1], self.vocab), -mx.inf, logits.dtype)
        return mx.put_along_axis(full, ids, logits, axis=-1), ids


def gemma4_assistant_config(raw: dict[str, Any]) -> AssistantConfig:
    """A `gemma4_assistant` config.json (top level + `text_config`) as an `AssistantConfig`."""
    from mlx_lm.models.gemma4_text import ModelArgs

    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"not a {MODEL_TYPE} config (model_type {raw.get('model_type')!r})")
    text = dict(raw.get("text_config") or {})
    for key in ("hidden_size_per_layer_input", "enable_moe_block"):
        if text.get(key):
            raise ValueError(f"a Gemma 4 assistant must have no {key} (got {text[key]!r})")
    args = ModelArgs.from_dict(text)  # gemma4_text's defaults (layer_types, head dims)
    ordered = bool(raw.get("use_ordered_embeddings", False))
    vocab = int(args.vocab_size)
    B = int(raw["backbone_hidden_size"])
    return AssistantConfig(
        backbone_hidden_size=B,
        hidden_size=int(args.hidden_size),
        intermediate_size=int(args.intermediate_size),
        num_attention_heads=int(args.num_attention_heads),
        head_dim=int(args.head_dim),
        global_head_dim=int(args.global_head_dim or 0),
        layer_types=list(args.layer_types),
        model_type=MODEL_TYPE,
        rms_norm_eps=float(args.rms_norm_eps),
        norm_offset=0.0,  # gemma4_text's RMSNorm scales by weight itself (no 1 + weight)
        sandwich_norms=True,
        activation="gelu_approx",
        q_norm=True,
        attention_scale=1.0,
        embed_scale=math.sqrt(B),
        head="centroid" if ordered else "dense",
        draft_vocab_size=0 if ordered else vocab,
        target=str(raw.get("_name_or_path", "")),
        extra={
            "vocab_size": vocab,
            "num_centroids": int(raw.get("num_centroids", 2048)),
            "centroid_intermediate_top_k": int(raw.get("centroid_intermediate_top_k", 32)),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        },
    )


def gemma4_assistant_weights(
    weights: dict[str, mx.array], cfg: AssistantConfig
) -> dict[str, mx.array]:
    """Checkpoint tensors renamed onto `Assistant`; missing or unknown ones are refused."""
    ordered = cfg.head == "centroid"
    head = TIED_HEAD
    if not cfg.extra.get("tie_word_embeddings", True) and "lm_head.weight" in weights:
        head = "lm_head.weight"  # an untied checkpoint's own head
    names = {"pre_projection.weight": "pre_projection.weight",
             "post_projection.weight": "post_projection.weight",
             "model.norm.weight": "norm.weight",
             head: "centroid_head.embedding" if ordered else "lm_head.weight"}
    for i in range(len(cfg.layer_types)):
        names.update({f"model.layers.{i}.{t}": f"layers.{i}.{t}" for t in LAYER_TENSORS})
    if ordered:
        names.update({CENTROIDS: "centroid_head.centroids.weight",
                      ORDERING: "centroid_head.token_ordering"})
    ignored = {"lm_head.weight", TIED_HEAD} - {head}
    missing = sorted(set(names) - set(weights))
    unknown = sorted(set(weights) - set(names) - ignored)
    if missing or unknown:
        raise ValueError(
            f"not a Gemma 4 assistant checkpoint of this config: missing tensors "
            f"{_some(missing)}, unknown tensors {_some(unknown)}"
        )
    return {names[k]: v for k, v in weights.items() if k in names}


def _some(names: list[str], shown: int = 12) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def load_gemma4_assistant(folder: Path, dtype: mx.Dtype = mx.float32) -> Assistant:
    """An `Assistant` from a Google `gemma4_assistant` folder (config.json + *.safetensors)."""
    cfg = gemma4_assistant_config(json.loads((folder / CONFIG_FILE).read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors weights")
    raw: dict[str, mx.array] = {}
    for f in files:
        raw.update(mx.load(str(f)))
    weights = gemma4_assistant_weights(raw, cfg)
    model = Assistant(cfg)
    if cfg.head == "centroid":
        vocab, clusters = int(cfg.extra["vocab_size"]), int(cfg.extra["num_centroids"])
        model.centroid_head = CentroidHead(
            clusters, int(cfg.extra["centroid_intermediate_top_k"]), vocab, cfg.hidden_size
        )
        ordering = weights["centroid_head.token_ordering"]
        if ordering.shape != (vocab,) or not mx.issubdtype(ordering.dtype, mx.integer):
            raise ValueError(
                f"{ORDERING} must be {vocab} integer token ids, got {ordering.dtype} "
                f"{tuple(ordering.shape)}"
            )
    if cfg.head == "dense":
        weights["draft_vocab"] = model.draft_vocab  # the whole vocabulary, in order
    weights = {
        k: v.astype(mx.int32) if k in ("draft_vocab", "centroid_head.token_ordering")
        else v.astype(dtype)
        for k, v in weights.items()
    }
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
