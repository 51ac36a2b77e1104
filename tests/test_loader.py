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


def test_a_second_dtype_can_reuse_the_loaded_tokenizer(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    first = loader.load(folder, dtype="native", progress=False)
    second = loader.load(folder, dtype="float32", progress=False, tokenizer=first.tokenizer)
    assert second.tokenizer is first.tokenizer and second.dtype == "float32"
    assert second.model.model.embed_tokens.weight.dtype == mx.float32
    ids = mx.array([[1, 5, 9]])
    assert mx.allclose(first.model(ids), second.model(ids), atol=1e-2).item()


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


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ("{bad json", r"config\.json is not valid JSON"),
        ("[]", r"config\.json must hold a JSON object, not list"),
        ('{"model_type": "llama"}', r"config\.json does not describe a model mlx-lm can build"),
        (None, r"has no tokenizer \(tokenizer\.json"),
    ],
)
def test_a_broken_folder_is_refused_naming_what_is_wrong(tmp_path, config, words):
    """Broken config.json files and a folder without tokenizer files fail with one message
    naming the file (the CLI prints it as one `tandem: error:` line), not a traceback."""
    folder = make_tiny_model("llama", tmp_path / "tiny")
    if config is None:
        for name in loader.TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
    else:
        (folder / "config.json").write_text(config)
    with pytest.raises((ValueError, FileNotFoundError), match=words):
        loader.load(folder, progress=False)


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


# --- MLX-quantized folders (mlx_lm.convert's output, built with mlx-lm's own utilities) ---
@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """bits -> an MLX-quantized copy of a tiny llama, as `mlx_lm.convert -q` writes it."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import quantize_model, save

    root = tmp_path_factory.mktemp("quantized")
    source = make_tiny_model("llama", root / "source")
    out = {}
    for bits in (4, 8):
        model, tokenizer, config = mlx_lm_load(str(source), return_config=True)
        model, config = quantize_model(model, config, group_size=64, bits=bits)
        save(root / f"q{bits}", source, model, tokenizer, config)
        out[bits] = root / f"q{bits}"
    return out


def _param_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_folder_runs_batch_invariant_in_the_rows_engine(quantized, bits):
    import mlx.nn as nn
    from test_engine import run_alone

    from mlx_tandem import SamplingParams
    from mlx_tandem.engine.config import RuntimeConfig
    from mlx_tandem.engine.core import EngineCore

    from conftest import run_with_gaps

    m = loader.load(quantized[bits], dtype="native", progress=False)
    assert any(isinstance(x, nn.QuantizedLinear) for _, x in m.model.named_modules())
    assert loader.weight_bytes(m.path, "native") == _param_bytes(m.model)
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=16)
    prompts = [[5, 6, 7], list(range(3, 40)), [9] * 11, [200, 100, 50, 25]]
    params = [SamplingParams(max_tokens=n) for n in (8, 5, 11, 7)]
    alone = [run_alone(m, p, sp, cfg) for p, sp in zip(prompts, params, strict=True)]
    assert len({t for a in alone for t in a}) > 4
    batched = run_with_gaps(EngineCore(m, cfg), prompts, params, seed=bits)
    assert [r.tokens for r in batched] == alone


@pytest.mark.parametrize("bits", [4, 8])
def test_float32_dequantizes_a_quantized_folder(quantized, bits):
    import mlx.nn as nn

    m = loader.load(quantized[bits], dtype="float32", progress=False)
    assert not any(
        isinstance(x, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, x in m.model.named_modules()
    )
    assert m.model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert loader.weight_bytes(m.path, "float32") == _param_bytes(m.model)
    native = loader.weight_bytes(m.path, "native")
    assert loader.weight_bytes(m.path, "float32") > native
    # the memory check counts the weights in the dtype they will have
    loader.check_fits(m.path, "q", "native", kv_budget=0, memory=native)
    with pytest.raises(ValueError, match=r"as float32 \(--dtype native keeps its quantization\)"):
        loader.check_fits(m.path, "q", "float32", kv_budget=0, memory=native)


# --- the memory check, before any weight is read ---
def test_a_model_that_does_not_fit_is_refused_before_loading(tmp_path, monkeypatch):
    folder = make_tiny_model("llama", tmp_path / "tiny")
    weights = loader.weight_bytes(folder)
    monkeypatch.setattr(loader, "device_memory", lambda: weights + (100 << 20))

    def never(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loader, "mlx_lm_load", never)
    mib = f"{weights / (1 << 20):.1f} MiB"
    with pytest.raises(ValueError, match=rf"'tiny' does not fit: its weights need {mib} as native "
                       r"\(from the safetensors headers\) \+ 256\.0 MiB KV-cache budget = .* MiB, "
                       r"more than the device's .* MiB"):
        loader.load(folder, dtype="native", progress=False)
    with pytest.raises(ValueError, match=r"\+ 100\.0 MiB KV-cache budget"):  # the budget counts
        loader.load(folder, dtype="native", progress=False, kv_budget=(100 << 20) + 1)
    monkeypatch.undo()
    assert loader.load(folder, dtype="native", progress=False, kv_budget=1).name == "tiny"
