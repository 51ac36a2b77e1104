"""Resolve a model argument to a loaded mlx-lm model, tokenizer and graph binding.

A model argument is a local mlx-lm folder, a `.gguf` file, or a catalogue name.
GGUF models are converted once into an mlx-lm folder under
`$TANDEM_HOME/prepared/` (a `COMPLETE` marker is written last, so an
interrupted conversion is redone) and loaded with mlx-lm's own loader.

Oracle: tests/test_loader.py (a GGUF is converted once; an interrupted conversion
leaves nothing and is redone; argument and dtype errors); real-model parity in
tests/test_real_models.py.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from mlx_tandem.models import catalogue
from mlx_tandem.models.graph import MlxLmGraph, bind_graph

DTYPES = ("auto", "native", "float32", "q8", "q4")
_MARKER = "COMPLETE"


@dataclass
class LoadedModel:
    """A model ready for the engines: weights, tokenizer, graph binding, limits."""

    name: str
    path: Path
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]
    graph: MlxLmGraph
    dtype: str

    @property
    def context_length(self) -> int:
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            if isinstance(self.config.get(key), int):
                return int(self.config[key])
        return 1 << 20

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    def encode(
        self,
        prompt: str,
        *,
        chat: bool = True,
        system_prompt: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids for a user prompt, through the chat template when there is one (as mlx-lm)."""
        messages: list[dict[str, Any]] = []
        if system_prompt is not None:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": prompt})
        return self.encode_messages(messages, chat=chat, template_kwargs=template_kwargs)

    def encode_text(self, prompt: str | list[int]) -> list[int]:
        """Ids as given, or a raw string encoded as mlx-lm does (BOS unless already present)."""
        if not isinstance(prompt, str):
            return list(prompt)
        bos = self.tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special))

    def encode_messages(
        self,
        messages: list[dict[str, Any]],
        *,
        chat: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        use_template = chat and self.tokenizer.has_chat_template
        if use_template:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        else:
            text = "\n".join(str(m["content"]) for m in messages)
        return list(self.tokenizer.encode(text, add_special_tokens=not use_template))


def default_dtype() -> str:
    """float32 on MLX's CPU backend (its quantized kernels are slow there); native on GPU."""
    return "float32" if mx.default_device() == mx.cpu else "native"


def resolve_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return default_dtype() if dtype == "auto" else dtype


def load(model: str | Path, dtype: str = "auto", progress: bool = True) -> LoadedModel:
    """Load a folder, a .gguf file or a catalogue name; see the module docstring."""
    dtype = resolve_dtype(dtype)
    arg = str(model)
    path = Path(arg).expanduser()
    if path.is_dir():
        folder, name = path, path.name
    elif arg.endswith(".gguf") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        stat = path.stat()
        key = f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        folder, name = prepare_gguf(path, key, dtype, progress), path.stem
    else:
        entry = catalogue.lookup(arg)
        gguf = catalogue.fetch(entry, quiet=not progress)
        folder, name = prepare_gguf(gguf, entry.name, dtype, progress), entry.name
    return load_folder(folder, name=name, dtype=dtype)


def prepared_dir(key: str, dtype: str) -> Path:
    return catalogue.tandem_home() / "prepared" / f"{key}-{dtype}"


def prepare_gguf(gguf: Path, key: str, dtype: str, progress: bool) -> Path:
    """Convert a GGUF once into an mlx-lm folder; later calls return the cached folder."""
    from mlx_tandem.models.gguf_import import convert_gguf

    target = prepared_dir(key, dtype)
    if (target / _MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf, staging, dtype=dtype, progress=progress)
        (staging / _MARKER).write_text(json.dumps({"gguf": str(gguf), "dtype": dtype}))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


def load_folder(folder: Path, name: str, dtype: str = "native") -> LoadedModel:
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not an mlx-lm model folder (no config.json)")
    model, tokenizer, config = mlx_lm_load(str(folder), return_config=True)
    if dtype == "float32" and not _is_prepared(folder):
        model = _to_float32(model)
    elif dtype in ("q8", "q4") and not _is_prepared(folder):
        raise ValueError(
            f"--dtype {dtype} re-quantizes GGUF imports only; convert folders with mlx_lm.convert"
        )
    return LoadedModel(
        name=name,
        path=folder,
        model=model,
        tokenizer=tokenizer,
        config=config,
        graph=bind_graph(model),
        dtype=dtype,
    )


def _is_prepared(folder: Path) -> bool:
    return (folder / _MARKER).exists()


def _to_float32(model: nn.Module) -> nn.Module:
    """Dequantize quantized layers and cast floating weights to float32 (CPU fast path)."""
    if any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()
    ):
        model = dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def prepared_models() -> list[Path]:
    root = catalogue.tandem_home() / "prepared"
    return sorted(p for p in root.glob("*") if (p / _MARKER).exists()) if root.exists() else []
