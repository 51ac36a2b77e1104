"""Tiny random-weight models of many mlx-lm architectures, for tests and benches.

`make_tiny_model(arch, folder)` writes a complete mlx-lm folder (config, random
weights, a byte-level BPE tokenizer with a chat template) and returns its
path; `load_folder` then loads it through the same path as real models.
`ARCHS` covers each cache kind the engines handle and is what most tests run:
`llama` and `qwen3` (KVCache), `gemma3_text` and `gemma4_text` (RotatingKVCache
sliding layers + full layers; Gemma 4 with per-layer inputs, optionally KV-shared
layers), `lfm2` (short-convolution ArraysCache + attention). `FAMILY_ARCHS` adds one
2-layer config per further family of models/families.py (the architecture matrix,
with `FAMILY_OVERRIDES` for the make_tiny_model arguments the matrix uses).

Oracle: tests/test_graph.py (tiny models of each family bind and run),
tests/test_families.py (the matrix).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<eos>", "<bos>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
}

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "gemma3_text": {
        "model_type": "gemma3_text",
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
    },
    # Gemma 4 (E2B-like): sliding + full layers, full ones with their own head width and
    # partial RoPE, per-layer inputs. No KV-shared layers by default: the rows engine cannot
    # run them (mlx-lm calls their attention with no cache, so it cannot route to a row
    # cache). Untied head: a random tied Gemma 4 mostly repeats its last token.
    "gemma4_text": {
        "model_type": "gemma4_text",
        "global_head_dim": 32,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 8,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": False,
    },
    # hybrid: short-convolution recurrent layers (ArraysCache) + attention layers
    "lfm2": {
        "model_type": "lfm2",
        "rope_theta": 1000000.0,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "tie_word_embeddings": True,
    },
}

# The family matrix (models/families.py): one tiny config per further mlx-lm family, each
# 2 layers (hybrids: one recurrent + one attention layer), built from mlx-lm's own classes.
_TWO = {"num_hidden_layers": 2}
_LINEAR_ATTN = {  # Qwen3-Next / Qwen3.5 Gated DeltaNet layers
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
}
_MINISTRAL3 = {
    **_TWO,
    "model_type": "ministral3",
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 16,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": 64,
    },
}
FAMILY_ARCHS: dict[str, dict[str, Any]] = {
    "qwen2": {**_TWO, "model_type": "qwen2", "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "qwen3_moe": {
        **_TWO,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 1000000.0,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "gemma2": {
        **_TWO,
        "model_type": "gemma2",
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "mamba2": {
        **_TWO,
        "model_type": "mamba2",
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 16,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, 1000.0],
        "time_step_rank": "auto",
    },
    "ministral3": _MINISTRAL3,
    # Mistral 3 as mlx-community ships it: a multimodal wrapper around a ministral3 text model
    "mistral3": {"model_type": "mistral3", "text_config": _MINISTRAL3},
    "phi3": {**_TWO, "model_type": "phi3", "rope_theta": 10000.0},
    "olmo2": {**_TWO, "model_type": "olmo2", "tie_word_embeddings": False},
    "granite": {
        **_TWO,
        "model_type": "granite",
        "logits_scaling": 2.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "smollm3": {
        **_TWO,
        "model_type": "smollm3",
        "no_rope_layer_interval": 2,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {
        **_TWO,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000,
    },
    "qwen3_next": {
        **_TWO,
        **_LINEAR_ATTN,
        "model_type": "qwen3_next",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "rope_theta": 1000000.0,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
    },
    "qwen3_5": {
        **_TWO,
        **_LINEAR_ATTN,
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "rope_parameters": {
            "type": "default",
            "mrope_section": [1, 1, 0],
            "rope_theta": 100000.0,
            "partial_rotary_factor": 0.25,
        },
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": ["M", "*"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "falcon_h1": {
        **_TWO,
        "model_type": "falcon_h1",
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_heads": 4,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}

# make_tiny_model arguments for the matrix: a random tied head mostly repeats one token,
# a weak test, so heads are untied (LFM2 and Gemma 2 always tie theirs: their layers are
# sharpened instead, and Gemma 2's embedding softened, its post-norms cap the layers).
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {"tie_word_embeddings": False},
    "gemma3_text": {"tie_word_embeddings": False},
    "lfm2": {"layer_scale": 3.0},
    "gemma2": {"layer_scale": 3.0, "embed_scale": 0.25},
}


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols (no merges) plus a few special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def make_tiny_model(
    arch: str,
    folder: Path,
    seed: int = 0,
    layer_scale: float = 1.0,
    embed_scale: float = 4.0,
    **overrides: Any,
) -> Path:
    """Write a random-weight mlx-lm model folder for `arch`; returns the folder.

    The embedding is multiplied by `embed_scale` (sharper argmaxes) and every layer matrix
    by `layer_scale`: with an always-tied head (LFM2, Gemma 2) a random model otherwise
    just repeats its last token."""
    from mlx_lm.utils import _get_classes

    known = {**ARCHS, **FAMILY_ARCHS}
    if arch not in known:
        raise ValueError(f"unknown tiny arch {arch!r} (known: {', '.join(known)})")
    tokenizer = tiny_tokenizer()
    config = {**_COMMON, **known[arch], "vocab_size": tokenizer.get_vocab_size(), **overrides}
    config = json.loads(json.dumps(config))  # a deep copy: model args may edit nested dicts
    if "text_config" in config:  # a multimodal wrapper: the text model's config nests
        text = {k: v for k, v in config.items() if k not in ("model_type", "text_config")}
        nested = {**text, **config["text_config"]}
        config = {"model_type": config["model_type"], "text_config": nested}
    if arch == "gemma4_text":
        config.setdefault("vocab_size_per_layer_input", config["vocab_size"])
    config["eos_token_id"] = tokenizer.token_to_id("<eos>")
    config["bos_token_id"] = tokenizer.token_to_id("<bos>")
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Sharper than the default init, so greedy decoding has clear (non-tied) argmaxes.
    params = {}
    for k, v in tree_flatten(model.parameters()):
        if k.endswith(("embed_tokens.weight", "embeddings.weight")):
            v = v * embed_scale
        elif k.endswith(".sinks"):  # gpt_oss's attention sinks start at zero: make them count
            v = 2.0 * mx.random.normal(v.shape)
        elif layer_scale != 1.0 and ".layers." in k and v.ndim >= 2:
            v = v * layer_scale
        params[k] = v
    if arch in ("gemma3_text", "gemma4_text") and config.get("tie_word_embeddings", True):
        params.pop("lm_head.weight", None)  # tied, as in the real model
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), params)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "bos_token": "<bos>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return folder
