"""Resolve a model argument to a loaded mlx-lm model, tokenizer and graph binding.

A model argument is a local mlx-lm folder (MLX-quantized `mlx_lm.convert` output
included), a `.gguf` file, a catalogue name, or a Hugging Face repo id (`owner/name`,
resolved by mlx-lm's own hub download: the local HF cache, else the hub; offline and
not cached is an error naming the id). GGUF models are converted once into an mlx-lm
folder under `$TANDEM_HOME/prepared/` (a `COMPLETE` marker is written last, so an
interrupted conversion is redone) and loaded with mlx-lm's own loader.

Before any weight is read, the weights' size (from the safetensors headers, as they
will be held in the chosen dtype: `float32` dequantizes an MLX-quantized folder) plus
the KV-cache budget must fit the device's memory, else the model is refused with
the numbers.

Oracle: tests/test_loader.py (a GGUF is converted once; an interrupted conversion
leaves nothing and is redone; argument and dtype errors; hub ids offline; quantized
folders and the memory check); real-model parity in tests/test_real_models.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_model
from mlx_lm.utils import load as mlx_lm_load

from mlx_tandem._blas import check_blas_setting
from mlx_tandem.models import catalogue
from mlx_tandem.models.graph import MlxLmGraph, bind_graph

DTYPES = ("auto", "native", "float32", "q8", "q4")
_MARKER = "COMPLETE"
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
MIN_KV_BYTES = 256 << 20  # the engine's smallest KV-cache budget (engine/scheduler.py)
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4,
                      "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                      "F8_E5M2": 1}


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
    # the rows engine's projection plans, probed once for these weights' shapes by the
    # first engine (models/invariance.stable_projections): (kind, shape, ...) -> RowPlan
    row_plans: dict[tuple, Any] = field(default_factory=dict)

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

    def encode_text(self, prompt: str | Sequence[int] | mx.array) -> list[int]:
        """Ids as given (a list, or a 1-D integer numpy / MLX array), or a raw string encoded
        as mlx-lm does (BOS unless already present). TypeError for anything else."""
        if not isinstance(prompt, str):
            return token_ids(prompt)
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


def load(
    model: str | Path,
    dtype: str = "auto",
    progress: bool = True,
    kv_budget: int | None = None,
    tokenizer: TokenizerWrapper | None = None,
) -> LoadedModel:
    """Load a folder, a .gguf file, a catalogue name or a Hugging Face repo id; see the
    module docstring. `kv_budget`: the KV-cache bytes the engine will be given (None: its
    smallest budget), counted with the weights against the device's memory. `tokenizer`:
    this model's tokenizer, already loaded (e.g. with another dtype), used instead of
    reading it again (Gemma's 262k-token vocabulary takes ~10 s on a CPU)."""
    check_blas_setting()
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
    elif arg not in catalogue.CATALOGUE and HF_REPO_ID.match(arg):
        folder, name = hub_folder(arg), arg
    else:
        entry = catalogue.lookup(arg)
        gguf = catalogue.fetch(entry, quiet=not progress)
        folder, name = prepare_gguf(gguf, entry.name, dtype, progress), entry.name
    return load_folder(folder, name=name, dtype=dtype, kv_budget=kv_budget, tokenizer=tokenizer)


def hub_folder(repo: str) -> Path:
    """A Hugging Face repo's local snapshot through mlx-lm's own download (HF cache first).
    Raises FileNotFoundError naming the repo when the hub cannot provide it."""
    from huggingface_hub import constants, errors
    from mlx_lm.utils import _download

    try:
        return _download(repo)
    except errors.LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {repo!r}: the Hugging Face hub is unreachable (offline, or HF_HUB_OFFLINE "
            f"is set) and the repo is not in the local HF cache ({constants.HF_HUB_CACHE}); "
            f"download it where the hub is reachable (`hf download {repo}`) or pass a local "
            "mlx-lm folder"
        ) from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo!r}: no such repo on the Hugging Face hub (or it is private or "
            "gated: log in with `hf auth login`)"
        ) from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo!r}: the hub has no such revision") from None
    except errors.HfHubHTTPError as err:
        raise RuntimeError(f"model {repo!r}: the Hugging Face hub failed: {err}") from None


def device_memory() -> int:
    """Bytes of memory MLX's device has (the machine's RAM on the CPU backend)."""
    try:
        return int(mx.device_info()["memory_size"])
    except (AttributeError, KeyError, RuntimeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict; ValueError naming the file otherwise."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config


def weight_bytes(folder: Path, dtype: str = "native") -> int:
    """The bytes the folder's weights take once loaded in `dtype`, from the safetensors
    headers alone (no tensor is read). `float32` counts every floating tensor at 4 bytes
    and a quantized weight (an MLX-quantized folder) dequantized: its scales and biases go."""
    config = read_config(folder)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = int(quant.get("bits", 0) or 0)
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        for key, info in _safetensors_header(file).items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            size = end - start
            if dtype == "float32":
                if bits and key.endswith((".scales", ".biases")):
                    size = 0
                elif bits and info["dtype"] == "U32":
                    size = size * 8 // bits * 4  # packed bits-wide values -> float32
                elif info["dtype"].startswith(("F", "BF")):
                    size = size // _SAFETENSORS_BYTES.get(info["dtype"], 4) * 4
            total += size
    return total


def _safetensors_header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError(f"{file} is not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def check_fits(
    folder: Path,
    name: str,
    dtype: str,
    kv_budget: int | None = None,
    memory: int | None = None,
) -> None:
    """Refuse (ValueError, with the numbers) weights + KV budget beyond the device's memory."""
    weights = weight_bytes(folder, dtype)
    kv = kv_budget if kv_budget is not None else MIN_KV_BYTES
    memory = memory if memory is not None else device_memory()
    if weights + kv > memory:
        hint = " (--dtype native keeps its quantization)" if dtype == "float32" else ""
        raise ValueError(
            f"model {name!r} does not fit: its weights need {_size(weights)} as {dtype}{hint} "
            f"(from the safetensors headers) + {_size(kv)} KV-cache budget = "
            f"{_size(weights + kv)}, more than the device's {_size(memory)}"
        )


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


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


def load_folder(
    folder: Path,
    name: str,
    dtype: str = "native",
    kv_budget: int | None = None,
    tokenizer: TokenizerWrapper | None = None,
) -> LoadedModel:
    """Load an mlx-lm folder: checked (config, dtype, memory) before any weight is read.
    `tokenizer`: see `load`."""
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} is not an mlx-lm model folder (no config.json)")
    read_config(folder)  # a JSON object, or a ValueError naming the file
    if tokenizer is None and not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}): copy the model's "
            "tokenizer files into the folder")
    if dtype in ("q8", "q4") and not _is_prepared(folder):
        raise ValueError(
            f"--dtype {dtype} re-quantizes GGUF imports only; convert folders with mlx_lm.convert"
        )
    check_fits(folder, name, "native" if _is_prepared(folder) else dtype, kv_budget)
    try:
        if tokenizer is None:
            model, tokenizer, config = mlx_lm_load(str(folder), return_config=True)
        else:
            model, config = load_model(folder)
    except (TypeError, KeyError) as err:  # the model class refused the config's fields
        raise ValueError(f"{folder / 'config.json'} does not describe a model mlx-lm can "
                         f"build: {type(err).__name__}: {err}") from None
    if dtype == "float32" and not _is_prepared(folder):
        model = _to_float32(model)
    return LoadedModel(
        name=name,
        path=folder,
        model=model,
        tokenizer=tokenizer,
        config=config,
        graph=bind_graph(model, fuse=True),
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


def token_ids(prompt: object) -> list[int]:
    """A prompt's token ids as Python ints: from a sequence of ints or a 1-D integer numpy or
    MLX array (what mlx-lm's generate takes). TypeError naming what was given otherwise."""
    if isinstance(prompt, (mx.array, np.ndarray)):
        kind = str(prompt.dtype)
        if prompt.ndim != 1 or "int" not in kind:
            raise TypeError(
                f"a prompt array must hold 1-D integer token ids, not {prompt.ndim}-D {kind}")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"prompt must be text or token ids (a list of ints), not {type(prompt).__name__}")
    return [int(t) if isinstance(t, np.integer) else t for t in prompt]
