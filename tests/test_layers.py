"""Imports point one way, down the layers, and no two modules import each other (even for types)."""

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "mlx_tandem"

# lower number = lower layer; a package may import only from strictly lower layers (or itself)
LAYERS = {
    "_blas": 0,
    "kv": 1,
    "models": 2,
    "engine": 3,
    "drafters": 4,
    "lab": 5,  # trains drafters: uses models and engine-free features
    "mlx_tandem": 5,  # the package's public API (__init__)
    "server": 5,
    "cli": 6,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache  # parsed once per worker: every parametrized case reads the same tree
def imports() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = set()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or node.level):
                source = node.module or ""
                if node.level:  # relative: `from .x import y` inside package p reads p.x
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    source = f"{base}.{source}" if source else base
                # `from pkg import submodule` depends on the submodule, not on pkg/__init__
                subs = {f"{source}.{a.name}" for a in node.names} & set(paths)
                found |= subs or {source}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[module] = {n for n in found if n in paths and n != module}
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else parts[0]]


def test_relative_imports_are_read():
    """`from .gguf_tokenizer import save_tokenizer` (models/gguf_import.py) is an edge too."""
    assert "mlx_tandem.models.gguf_tokenizer" in imports()["mlx_tandem.models.gguf_import"]


def test_every_package_has_a_layer():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} | {"_blas"} <= set(
        LAYERS
    )


@pytest.mark.parametrize("module", sorted(imports()))
def test_imports_point_down(module):
    graph = imports()
    package = module.split(".")[:2]
    upward = [
        dep
        for dep in graph[module]
        if dep.split(".")[:2] != package and layer(dep) >= layer(module)
    ]
    assert not upward, f"{module} imports from its own or a higher layer: {upward}"


def test_no_import_cycles():
    graph = imports()
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle.extend([*path[path.index(dep) :], dep] if dep in path else [node, dep])
                return True
            if dep not in state and visit(dep, [*path, dep]):
                return True
        state[node] = 2
        return False

    for start in sorted(graph):
        if start not in state and visit(start, [start]):
            break
    assert not cycle, " -> ".join(cycle)
