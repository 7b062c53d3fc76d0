"""The dataset contract is importable without Beam, and training reaches pipelines/ only through it.

Each check imports in a fresh interpreter: in this process Beam is already loaded by other tests.
"""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import bertforge.pipelines.contract as contract
import bertforge.training as training

CONTRACT = "bertforge.pipelines.contract"
CONTRACT_MODULES = [CONTRACT] + [
    f"{CONTRACT}.{info.name}" for info in pkgutil.iter_modules(contract.__path__)
]


def imports_beam(modules: list[str]) -> list[str]:
    """The modules after whose import `apache_beam` was loaded, imported in this order."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'apache_beam' in sys.modules:\n"
        "        print('beam after', name)\n"
        "        break\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    # DeepSpeed logs to stdout on import: keep only our own lines
    lines = result.stdout.splitlines()
    return [line.split()[-1] for line in lines if line.startswith("beam after ")]


def pipelines_imports(path: Path) -> list[str]:
    """Every `bertforge.pipelines...` module a file imports, at any depth (lazy imports too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bertforge.pipelines" or node.module.startswith(
                "bertforge.pipelines."
            ):
                # `from bertforge.pipelines.contract import manifest` names a module too
                found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("bertforge.pipelines")]
    return found


TRAINING_ROOT = Path(training.__path__[0])
TRAINING_FILES = sorted(TRAINING_ROOT.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(TRAINING_ROOT).with_suffix("").parts
    return ".".join(["bertforge.training", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def test_contract_modules_are_found():
    assert {f"{CONTRACT}.manifest", f"{CONTRACT}.tokenization"} <= set(CONTRACT_MODULES)


@pytest.mark.parametrize("module", CONTRACT_MODULES)
def test_contract_does_not_import_beam(module):
    assert imports_beam([module]) == []


def test_training_imports_pipelines_only_through_the_contract():
    outside = {
        f"{module_name(path)}: {name}"
        for path in TRAINING_FILES
        for name in pipelines_imports(path)
        if not (name == CONTRACT or name.startswith(CONTRACT + "."))
    }
    assert not outside, f"training/ imports pipelines/ outside the contract: {sorted(outside)}"


def test_training_modules_that_use_the_contract_do_not_import_beam():
    users = [p for p in TRAINING_FILES if pipelines_imports(p)]
    assert users, "no training module imports the contract: is the scan still right?"
    modules = [module_name(p) for p in users]
    assert imports_beam(modules) == []
