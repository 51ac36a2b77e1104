"""Tiny random-weight models of several mlx-lm architectures, for tests and benches.

`make_tiny_model(arch, folder)` writes a complete mlx-lm folder (config, random
weights, a byte-level BPE tokenizer with a chat template) and returns its
path; `load_folder` then loads it through the same path as real models.
Architectures cover each cache kind the engines handle: `llama` and `qwen3`
(KVCache), `gemma3_text` and `gemma4_text` (RotatingKVCache sliding layers + full
layers; Gemma 4 with per-layer inputs, optionally KV-shared layers).

Oracle: tests/test_graph.py (tiny models of each family bind and run).
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


def make_tiny_model(arch: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight mlx-lm model folder for `arch`; returns the folder."""
    from mlx_lm.utils import _get_classes

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r} (known: {', '.join(ARCHS)})")
    tokenizer = tiny_tokenizer()
    config = {**_COMMON, **ARCHS[arch], "vocab_size": tokenizer.get_vocab_size(), **overrides}
    if arch == "gemma4_text":
        config.setdefault("vocab_size_per_layer_input", config["vocab_size"])
    config["eos_token_id"] = tokenizer.token_to_id("<eos>")
    config["bos_token_id"] = tokenizer.token_to_id("<bos>")
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Sharper than the default init, so greedy decoding has clear (non-tied) argmaxes.
    params = {
        k: v * 4.0 if k.endswith("embed_tokens.weight") else v
        for k, v in tree_flatten(model.parameters())
    }
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
