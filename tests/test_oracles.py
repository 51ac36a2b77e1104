"""Every test a module header names as its oracle exists and holds at least one test."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "mlx_tandem"
NAMED = re.compile(r"tests/[\w/]+\.py")


def _headers() -> dict[Path, str]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            out[path] = doc
    return out


def _has_tests(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
        for node in ast.walk(tree)
    )


def test_every_named_oracle_exists_and_has_tests():
    named = {
        (path.relative_to(ROOT).as_posix(), test)
        for path, doc in _headers().items()
        for test in NAMED.findall(doc)
    }
    assert len(named) > 10  # the headers are being read
    missing = sorted(f"{src} names {test}" for src, test in named if not (ROOT / test).is_file())
    assert not missing
    empty = sorted(test for _, test in named if not _has_tests(ROOT / test))
    assert not empty

