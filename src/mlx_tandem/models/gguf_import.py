"""Convert a llama.cpp GGUF file into an mlx-lm model folder (config, safetensors, tokenizer).

Owns: a fast GGUF header reader (gguf's GGUFReader takes ~20 s on Gemma 3's 262k-token vocabulary;
this one ~0.3 s), the GGUF -> mlx-lm tensor-name and config mapping for `llama` and `gemma3`, and the
llama.cpp conventions that must be undone (llama q/k row permutation; Gemma's +1 on every norm).
Q4_0/Q4_1/Q8_0 blocks are repacked bit-exactly as MLX affine weights (group 32, float32 scales and
biases); every other type is decoded with `gguf.quants.dequantize` (never `mx.load`, which fails on
Q5_0 and mis-decodes Q4_K). See shared/reference/GGUF_NOTES.md.

Oracles: tests/test_gguf_import.py checks logits against an mlx-lm model built from the same float
weights (synthetic GGUFs), repacking against `gguf.quants.dequantize`, and greedy tokens and prompt
ids against llama.cpp (tests/data/llamacpp_greedy.json; greedy tokens in tests/test_goldens.py);
bench/perplexity.py checks Gemma 3's ppl.

Oracle: tests/test_gguf_import.py.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from mlx_tandem.models.gguf_tokenizer import save_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
DTYPES = ("native", "float32", "q8", "q4")
NATIVE_GROUP_SIZE = 32  # the block size of Q4_0 / Q4_1 / Q8_0
REQUANT_GROUP_SIZE = 64
_MAX_SHARD_BYTES = 5 << 30

_Q = GGMLQuantizationType
_NATIVE_BITS = {_Q.Q4_0: 4, _Q.Q4_1: 4, _Q.Q8_0: 8}
# GGUF scalar value types -> struct / numpy type characters (little-endian); 8 string, 9 array.
_SCALAR = {**dict(enumerate("BbHhIif?")), 10: "Q", 11: "q", 12: "d"}


# ----------------------------------------------------------------------------- GGUF reading
class UnsupportedGGUFError(ValueError):
    """A well-formed GGUF this reader does not handle (version, byte order)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's header entry; `shape` is in numpy (row-major) order, i.e. GGUF dims reversed."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A memory-mapped GGUF v2/v3 file: `metadata` (arrays as numpy / list[str]) and `tensors`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        if not self.path.is_file():
            raise ValueError(f"{self.path} is not a file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise ValueError(
                    f"{self.path} is not a GGUF file (magic {magic!r}, expected b'GGUF')"
                )
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError) as e:
                raise ValueError(f"GGUF file {self.path} is truncated or corrupt: {e}") from e
        self._off = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        try:
            self._parse()
        except UnsupportedGGUFError:
            raise
        except (struct.error, ValueError, KeyError, IndexError, OverflowError, MemoryError) as e:
            raise ValueError(f"GGUF file {self.path} is truncated or corrupt: {e}") from e

    def _take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._mm, self._off)[0]
        self._off += struct.calcsize(fmt)
        return value

    def _count(self, item_bytes: int) -> int:
        n = self._take("<Q")
        if n * item_bytes > len(self._mm) - self._off:
            raise ValueError(f"count {n} at byte {self._off} runs past the end of the file")
        return n

    def _str(self) -> str:
        n = self._count(1)
        raw = self._mm[self._off : self._off + n]
        self._off += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._str()
        if vtype != 9:
            return self._take("<" + _SCALAR[vtype])
        etype = self._take("<I")
        if etype in (8, 9):
            n = self._count(8 if etype == 8 else 12)
            return [self._value(etype) for _ in range(n)]
        dtype = np.dtype("<" + _SCALAR[etype])
        n = self._count(dtype.itemsize)
        arr = np.frombuffer(self._mm, dtype=dtype, count=n, offset=self._off).copy()
        self._off += n * dtype.itemsize
        return arr

    def _parse(self) -> None:
        self._off = 4
        self.version = self._take("<I")
        if self.version not in (2, 3):
            raise UnsupportedGGUFError(
                f"{self.path}: unsupported GGUF version {self.version} "
                "(expected 2 or 3, little-endian)"
            )
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        for _ in range(n_kv):
            key = self._str()
            self.metadata[key] = self._value(self._take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = [self._take("<Q") for _ in range(self._take("<I"))]
            infos.append((name, dims, GGMLQuantizationType(self._take("<I")), self._take("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = (self._off + align - 1) // align * align
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64))
            tensor = GGUFTensor(
                name,
                qtype,
                tuple(int(d) for d in reversed(dims)),
                start + offset,
                n // block * type_size,
            )
            if tensor.offset + tensor.nbytes > len(self._mm):
                raise ValueError(
                    f"tensor {name} ends at byte {tensor.offset + tensor.nbytes}, "
                    f"past the end of the file ({len(self._mm)} bytes)"
                )
            self.tensors[name] = tensor

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 (rows..., bytes per row), zero-copy."""
        t = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[t.ggml_type]
        data = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return data.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)

    def float32(self, name: str) -> np.ndarray:
        """The tensor decoded to float32 with gguf.quants.dequantize (every type gguf supports)."""
        t = self.tensors[name]
        try:
            out = gguf_quants.dequantize(self.raw(name), t.ggml_type)
        except NotImplementedError as e:
            raise ValueError(
                f"tensor {name}: cannot decode GGML type {t.ggml_type.name}: {e}"
            ) from e
        return np.asarray(out, dtype=np.float32).reshape(t.shape)


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file (FileNotFoundError / ValueError with a clear message on bad input)."""
    return GGUFFile(path)


def to_mlx_affine(raw: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, ...]:
    """Repack Q4_0 / Q4_1 / Q8_0 rows as MLX affine (weight uint32, scales, biases float32).

    Bit-exact: value = scale * q + bias reproduces gguf's d * (q - offset) (+ m) exactly, since
    every product of a float16 scale and a small integer is exact in float32.
    """
    rows = raw.shape[0]
    if qtype == _Q.Q8_0:
        blocks = raw.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        weight = np.ascontiguousarray(q.reshape(rows, -1)).view("<u4")
        return weight, d, d * np.float32(-128)
    size = {_Q.Q4_0: 18, _Q.Q4_1: 20}[qtype]
    blocks = raw.reshape(rows, -1, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == _Q.Q4_0:
        bias, packed = d * np.float32(-8), blocks[..., 2:]
    else:
        bias, packed = (
            blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32),
            blocks[..., 4:],
        )
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1, 8).astype(np.uint32)
    weight = np.zeros(q.shape[:2], dtype=np.uint32)
    for j in range(8):
        weight |= q[..., j] << np.uint32(4 * j)
    return weight, d, bias


# ----------------------------------------------------------------------------- architectures
_COMMON_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_LLAMA_NAMES = {**_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
_GEMMA3_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MATRICES = frozenset({"token_embd", "output", *_BLOCK_NAMES} - {"attn_norm"})


def _meta(g: GGUFFile, arch: str, key: str, default: Any = None) -> Any:
    value = g.metadata.get(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"GGUF file {g.path} lacks required metadata {arch}.{key}")
    return value


def _rope_scaling(g: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = g.metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(_meta(g, arch, "rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported (only 'linear')")


def _base_config(g: GGUFFile, arch: str) -> dict[str, Any]:
    hidden = int(_meta(g, arch, "embedding_length"))
    heads = int(_meta(g, arch, "attention.head_count"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(g, arch, "block_count")),
        "intermediate_size": int(_meta(g, arch, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(g, arch, "attention.head_count_kv", heads)),
        "head_dim": int(_meta(g, arch, "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_meta(g, arch, "attention.layer_norm_rms_epsilon")),
        "vocab_size": int(g.tensors["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(_meta(g, arch, "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def _llama_config(g: GGUFFile) -> dict[str, Any]:
    if "rope_freqs.weight" in g.tensors:
        raise ValueError("GGUF llama files with rope_freqs (llama3 rope scaling) are not supported")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **_base_config(g, "llama"),
    }
    rope_dim = int(_meta(g, "llama", "rope.dimension_count", config["head_dim"]))
    if rope_dim != config["head_dim"]:
        raise ValueError(f"partial rotary (rope dims {rope_dim} < head dim) is not supported")
    config.update(
        rope_theta=float(_meta(g, "llama", "rope.freq_base", 10000.0)),
        rope_traditional=False,  # q/k rows are un-permuted back to the Hugging Face layout
        rope_scaling=_rope_scaling(g, "llama"),
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        mlp_bias=False,
    )
    return config


def _gemma3_config(g: GGUFFile) -> dict[str, Any]:
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **_base_config(g, "gemma3"),
    }
    pattern = g.metadata.get("gemma3.attention.sliding_window_pattern", 6)
    if not isinstance(pattern, (int, np.integer)):
        raise ValueError("per-layer gemma3.attention.sliding_window_pattern is not supported")
    # llama.cpp's gemma3 scales queries by 1/sqrt(head_dim), except 27B (62 layers): hidden/heads.
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    config.update(
        rope_theta=float(_meta(g, "gemma3", "rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=float(g.metadata.get("gemma3.rope.freq_base_swa", 10_000.0)),
        sliding_window=int(_meta(g, "gemma3", "attention.sliding_window")),
        sliding_window_pattern=int(pattern),
        query_pre_attn_scalar=scalar,
        rope_scaling=_rope_scaling(g, "gemma3"),
    )
    return config


_ARCHS: dict[str, tuple[Callable[[GGUFFile], dict[str, Any]], dict[str, str]]] = {
    "llama": (_llama_config, _LLAMA_NAMES),
    "gemma3": (_gemma3_config, _GEMMA3_NAMES),
}


def _mlx_name(gguf_name: str, names: dict[str, str]) -> tuple[str, str]:
    """(mlx-lm parameter path without suffix, GGUF role like 'attn_q'); ValueError if unknown."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _COMMON_NAMES:
        return _COMMON_NAMES[parts[0]], parts[0]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}", parts[2]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no mlx-lm counterpart")


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row index undoing llama.cpp's convert_hf_to_gguf `permute` of q/k projections."""
    head_dim = n_rows // n_head
    return np.arange(n_rows).reshape(n_head, head_dim // 2, 2).swapaxes(1, 2).reshape(-1)


# ----------------------------------------------------------------------------- conversion
def _convert_tensors(
    g: GGUFFile, arch: str, config: dict[str, Any], dtype: str, progress: bool
) -> tuple[dict[str, Any], dict[str, dict[str, int]]]:
    import mlx.core as mx
    from tqdm import tqdm

    names = _ARCHS[arch][1]
    weights: dict[str, Any] = {}
    quantized: dict[str, dict[str, int]] = {}
    bits = {"q8": 8, "q4": 4}.get(dtype)
    for name in tqdm(
        list(g.tensors), desc=f"GGUF->MLX {dtype}", unit="tensor", disable=not progress
    ):
        t = g.tensors[name]
        path, role = _mlx_name(name, names)
        suffix = name.rsplit(".", 1)[1]
        perm = None
        if arch == "llama" and role in ("attn_q", "attn_k"):  # weight and bias rows alike
            heads = config["num_attention_heads" if role == "attn_q" else "num_key_value_heads"]
            perm = _unpermute_rows(t.shape[0], heads)
        if (
            dtype == "native"
            and t.ggml_type in _NATIVE_BITS
            and role in _MATRICES
            and suffix == "weight"
        ):
            parts = to_mlx_affine(g.raw(name), t.ggml_type)
            for key, arr in zip(("weight", "scales", "biases"), parts, strict=True):
                weights[f"{path}.{key}"] = mx.array(arr[perm] if perm is not None else arr)
            quantized[path] = {"group_size": NATIVE_GROUP_SIZE, "bits": _NATIVE_BITS[t.ggml_type]}
            continue
        x = g.float32(name)
        if perm is not None:
            x = x[perm]
        if arch == "gemma3" and role.endswith("norm"):
            x = x - np.float32(1.0)  # llama.cpp stores Gemma norms as 1 + w; mlx-lm adds the 1
        if bits and role in _MATRICES and x.ndim == 2 and x.shape[-1] % REQUANT_GROUP_SIZE == 0:
            w, s, b = mx.quantize(mx.array(x), group_size=REQUANT_GROUP_SIZE, bits=bits)
            weights.update({f"{path}.weight": w, f"{path}.scales": s, f"{path}.biases": b})
            quantized[path] = {"group_size": REQUANT_GROUP_SIZE, "bits": bits}
        else:
            weights[f"{path}.{suffix}"] = mx.array(x)
    return weights, quantized


def _quantization_config(quantized: dict[str, dict[str, int]]) -> dict[str, Any] | None:
    """mlx-lm `quantization`: the most common setting at top level, per-path dicts for the rest."""
    if not quantized:
        return None
    common = Counter((q["group_size"], q["bits"]) for q in quantized.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": common[0], "bits": common[1], "mode": "affine"}
    for path, q in quantized.items():
        if (q["group_size"], q["bits"]) != common:
            config[path] = {**q, "mode": "affine"}
    return config


def _save_weights(weights: dict[str, Any], out: Path) -> None:
    import mlx.core as mx

    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, Any]] = []
    size = 0
    for key, value in weights.items():
        if not shards or size + value.nbytes > _MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(out / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "native", progress: bool = True
) -> Path:
    """Convert a GGUF file into an mlx-lm model folder and return the folder.

    dtype: "native" (Q4_0/Q4_1/Q8_0 kept as MLX affine group-32 weights, everything else float32),
    "float32" (everything dequantized), "q8" / "q4" (dequantized, then linear and embedding weights
    re-quantized with group 64 and float32 scales). Existing model*.safetensors in out_dir are
    replaced.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
    g = read_gguf(gguf_path)
    arch = g.metadata.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    if "token_embd.weight" not in g.tensors:
        raise ValueError(f"GGUF file {g.path} has no token_embd.weight tensor")
    config = _ARCHS[arch][0](g)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = save_tokenizer(g.metadata, out)
    weights, quantized = _convert_tensors(g, arch, config, dtype, progress)
    _save_weights(weights, out)
    config.update(special)
    config.update(
        torch_dtype="float32",
        gguf_source={
            "file": g.path.name,
            "dtype": dtype,
            "tensor_types": dict(Counter(t.ggml_type.name for t in g.tensors.values())),
        },
    )
    if (quantization := _quantization_config(quantized)) is not None:
        config["quantization"] = quantization
    config = {k: v for k, v in config.items() if v is not None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
