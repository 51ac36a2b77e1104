"""Assistant folders on disk: which kinds exist and which loader reads each.

  * `tandem_assistant`: written by the lab (`tandem distill`), models/assistant.py;
  * `gemma4_assistant`: Google's Gemma 4 assistant checkpoints, models/gemma4_assistant.py.

Oracle: tests/test_lab.py (a distilled folder loads), tests/test_gemma4_assistant.py
(a Gemma 4 checkpoint folder loads).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlx_tandem.models.assistant import CONFIG_FILE, Assistant, load_tandem_assistant
from mlx_tandem.models.gemma4_assistant import MODEL_TYPE as GEMMA4
from mlx_tandem.models.gemma4_assistant import load_gemma4_assistant

TANDEM = "tandem_assistant"


def assistant_kind(path: Path) -> str | None:
    cfg = path / CONFIG_FILE
    if not cfg.is_file():
        return None
    kind = json.loads(cfg.read_text()).get("model_type")
    return kind if kind in (TANDEM, GEMMA4) else None


def is_assistant_folder(path: Path) -> bool:
    return assistant_kind(path) is not None


def load_assistant(folder: Path, dtype: mx.Dtype = mx.float32) -> Assistant:
    kind = assistant_kind(folder)
    if kind == GEMMA4:
        return load_gemma4_assistant(folder, dtype)
    if kind == TANDEM:
        return load_tandem_assistant(folder, dtype)
    raise ValueError(f"{folder} is not an assistant folder (no {CONFIG_FILE} with model_type "
                     f"{TANDEM!r} or {GEMMA4!r})")
