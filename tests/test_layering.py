"""The packages' layering, pipelines <- training <- cluster, and no private name borrowed from
another module: read from the sources (every import, module level or inside a function)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Each package and the packages it may import (DESIGN.md: Layout).
LAYERS = {"pipelines": (), "training": ("pipelines",), "cluster": ("pipelines", "training")}


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)


def _bertforge_imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names imported from it) of every import of a bertforge module."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("bertforge."):
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bertforge."):
            yield node.lineno, node.module, [alias.name for alias in node.names]


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_a_package_imports_only_itself_and_the_layers_below(package):
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path in _sources(package) for line, module, _ in _bertforge_imports(path)
             if module.split(".")[1] not in (package, *LAYERS[package])]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_module_imports_a_private_name_of_another(package):
    """A helper two modules share is public in the module that owns it."""
    borrowed = [f"{path.relative_to(REPO)}:{line} imports {name} from {module}"
                for path in _sources(package) for line, module, names in _bertforge_imports(path)
                for name in names if name.startswith("_")]
    assert not borrowed, "\n".join(borrowed)
