"""Model arguments resolve to folders; GGUFs are converted once, atomically, under TANDEM_HOME."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_tandem.models import gguf_import, loader
from mlx_tandem.models.tiny import make_tiny_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_convert(monkeypatch):
    """convert_gguf replaced by writing a tiny llama; `fail` makes the next call die midway."""
    state = {"calls": 0, "fail": False}

    def convert(gguf: Path, out: Path, dtype: str, progress: bool) -> None:
        state["calls"] += 1
        make_tiny_model("llama", out)
        if state.pop("fail", False):
            raise KeyboardInterrupt
        state["fail"] = False

    monkeypatch.setattr(gguf_import, "convert_gguf", convert)
    return state


def test_a_gguf_is_converted_once_and_loaded_from_the_prepared_folder(tmp_path, home, fake_convert):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = loader.load(gguf, dtype="native", progress=False)
    second = loader.load(str(gguf), dtype="native", progress=False)
    assert fake_convert["calls"] == 1
    assert first.path == second.path and (first.path / "COMPLETE").exists()
    assert first.path.parent == home / "prepared" and first.name == "m"
    assert loader.prepared_models() == [first.path]


def test_an_interrupted_conversion_leaves_nothing_and_is_redone(tmp_path, home, fake_convert):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fake_convert["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        loader.load(gguf, dtype="native", progress=False)
    assert list((home / "prepared").iterdir()) == []
    assert loader.load(gguf, dtype="native", progress=False).path.exists()
    assert fake_convert["calls"] == 2


def test_a_folder_loads_and_float32_casts_it(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    m = loader.load(folder, dtype="float32", progress=False)
    assert m.name == "tiny" and m.dtype == "float32"
    assert m.model.model.embed_tokens.weight.dtype == mx.float32
    assert m.graph.vocab_size == m.model.model.embed_tokens.weight.shape[0]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype 'f16'"):
        loader.load(tmp_path, dtype="f16")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        loader.load(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        loader.load("no-such-model")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        loader.load_folder(tmp_path, name="empty")
    folder = make_tiny_model("llama", tmp_path / "tiny")
    with pytest.raises(ValueError, match="re-quantizes GGUF imports only"):
        loader.load(folder, dtype="q4", progress=False)


# --- Hugging Face repo ids (no network: an offline or unreachable hub, a local HF cache) ---
REPO = "mlx-community/Qwen3-0.6B-4bit"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """huggingface_hub pointed at an empty cache under tmp_path and a hub that refuses
    connections (a closed local port): nothing can leave this machine."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf"


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_that_is_not_cached_fails_naming_it(hub, monkeypatch, offline):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(FileNotFoundError) as err:
        loader.load(REPO, dtype="native", progress=False)
    message = str(err.value)
    assert REPO in message and "unreachable" in message and "not in the local HF cache" in message


def test_a_hub_id_in_the_local_hf_cache_loads_offline(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--mlx-community--Qwen3-0.6B-4bit"
    make_tiny_model("qwen3", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    m = loader.load(REPO, dtype="native", progress=False)
    assert m.name == REPO and m.path == repo / "snapshots" / commit


def test_names_that_are_not_repo_ids_are_not_sent_to_the_hub(hub):
    with pytest.raises(ValueError, match="Hugging Face repo id"):
        loader.load("no-such-model")
    with pytest.raises(ValueError, match="unknown model"):
        loader.load("./a/b/c")
