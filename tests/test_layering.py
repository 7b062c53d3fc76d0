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


# cluster/'s rooms, top to bottom (cluster/__init__.py): each imports only the rooms below it.
CLUSTER_ROOMS = ("cli", "demo", "commands", "launch", "safety")


def _cluster_room(module: str) -> str | None:
    """`bertforge.cluster.launch.ray_train` -> "launch"; the package itself -> None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def test_cluster_is_rooms_and_each_imports_only_the_rooms_below():
    loose = sorted(p.name for p in (REPO / "cluster").glob("*.py")
                   if p.stem not in ("__init__", *CLUSTER_ROOMS))
    assert not loose, f"cluster/ modules outside a room: {loose}"
    wrong = []
    for path in _sources("cluster"):
        parts = path.relative_to(REPO / "cluster").with_suffix("").parts
        room = parts[0] if parts[0] != "__init__" else None
        if room is None:
            continue
        if room not in CLUSTER_ROOMS:
            wrong.append(f"{path.relative_to(REPO)}: in no room of {CLUSTER_ROOMS}")
            continue
        below = CLUSTER_ROOMS[CLUSTER_ROOMS.index(room):]
        for line, module, names in _bertforge_imports(path):
            if module == "bertforge.cluster":  # `from bertforge.cluster import launch`
                targets = names
            elif module.startswith("bertforge.cluster."):
                targets = [_cluster_room(module)]
            else:
                targets = []
            for target in targets:
                if target not in below:
                    wrong.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {module}")
    assert not wrong, "\n".join(wrong)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return "bertforge." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_import_each_other_even_indirectly():
    """An import circle (cluster/demo's run.py and summary.py had one) means two modules are
    one in two files: every import counts, at module level or inside a function."""
    modules = {_module_name(p): p for package in LAYERS for p in _sources(package)}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for _, module, names in _bertforge_imports(path):
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod.
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            graph[name].update(t for t in targets if t in modules and t != name)
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt):] + [node, nxt]
                                           if nxt in trail else [node, nxt]))
            elif nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not circles, "\n".join(circles)
