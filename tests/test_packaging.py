"""One namespace, `bertforge`, that Python and static tools resolve the same way.

- The installation `make install` makes (setuptools' strict editable mode) imports from any
  directory with no import hook: the package is found as files by the path-based finder, the
  way mypy, pyright and IDEs look for it, and holds every module of the checkout.
- A wheel, built from the files the Dockerfiles copy (`SOURCES`), installs `bertforge` and nothing
  else at the top of site-packages: into a fresh venv that already holds a user's own top-level
  `training` package, the console script and imports work and leave the user's `training` alone.
- The benchmarks run from a checkout on a machine where nothing is installed, after
  benchmarks/README.md's one offline pip step.

No network: a fresh venv gets the dependencies from this interpreter's site-packages through a
`.pth` file (its lines go on `sys.path` after the venv's own site-packages, and `.pth` files
inside those directories are not run, so this checkout's editable install stays out).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from bertforge.cluster.launch.checkout import package_folders
from tests.support.alone import alone_env

REPO = Path(__file__).resolve().parents[1]
FOLDERS = package_folders(str(REPO))  # pyproject.toml's [tool.bertforge] package-folders
# What a wheel is built from; infra/dataflow/Dockerfile and infra/docker/train.Dockerfile copy
# exactly these (tests/cluster/test_infra.py holds them to it).
SOURCES = ("pyproject.toml", "setup.py", "README.md", *FOLDERS)
USER_MARKER = "the user's own training package"


def _modules() -> set[str]:
    """Every module of the package folders, sub-packages included, as `bertforge/...` paths."""
    return {f"bertforge/{p.relative_to(REPO).as_posix()}" for folder in FOLDERS
            for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts}


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _fresh_venv(root: Path) -> SimpleNamespace:
    """A venv without pip or packages whose dependencies come from this interpreter's."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; "
                         "print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (purelib / "_test_dependencies.pth").write_text("".join(f"{p}\n" for p in deps))
    return SimpleNamespace(root=root, python=str(python), purelib=purelib)


def _sources(root: Path) -> Path:
    """A copy of the files a wheel is built from (a build writes build/ and *.egg-info beside
    them, which must not land in this checkout)."""
    root.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, root / name)
    return root


def test_the_folder_names_come_from_pyproject():
    assert FOLDERS == ("pipelines", "training", "cluster")


# Run from another directory by this interpreter: how does it find bertforge?
PROBE = """
import importlib.machinery, json, sys
import bertforge.cluster.cli
spec = importlib.machinery.PathFinder.find_spec("bertforge")
print(json.dumps({
    "cli": bertforge.cluster.cli.__file__,
    "hooks": [type(f).__module__ for f in sys.meta_path if "editable" in type(f).__module__],
    "portions": list(spec.submodule_search_locations),
}))
"""


def test_the_installed_package_is_files_on_the_path_with_every_module(tmp_path):
    """What a static tool sees: directories on sys.path (a `.pth` file's lines) holding
    bertforge/..., each module of the checkout among them (a module added since the last
    `make install` is missing until it runs again)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = json.loads(_run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env).stdout)
    assert found["hooks"] == []  # found by the path-based finder, as mypy and pyright look
    installed = {f"bertforge/{p.relative_to(portion).as_posix()}"
                 for portion in found["portions"]
                 for p in Path(portion).rglob("*.py") if "__pycache__" not in p.parts}
    missing = _modules() - installed
    assert not missing, f"not installed (run `make install` again): {sorted(missing)}"
    # The editable install's files are links to this checkout's: an edit shows at once.
    cli = Path(found["cli"])
    assert cli.resolve() == REPO / "cluster" / "cli.py"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    build = tmp_path_factory.mktemp("wheel")
    src = _sources(build / "src")
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "--no-index", str(src), "-w", str(build / "dist")])
    [built] = (build / "dist").glob("bertforge-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> SimpleNamespace:
    """The wheel in a fresh venv whose site-packages already holds a top-level `training`."""
    venv = _fresh_venv(tmp_path_factory.mktemp("fresh") / "venv")
    (venv.purelib / "training").mkdir()
    (venv.purelib / "training" / "__init__.py").write_text(f"MARKER = {USER_MARKER!r}\n")
    _run([sys.executable, "-m", "pip", "--python", venv.python, "install", "--quiet",
          "--no-deps", "--no-index", str(wheel)])
    return venv


def test_wheel_holds_every_module_under_bertforge_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    assert {n.split("/")[0] for n in names} == {"bertforge", entry_points.split("/")[0]}
    assert "bertforge/__init__.py" not in names  # a namespace package
    # Every module of the three folders, sub-packages included (a folder without __init__.py
    # would be dropped by find_packages), and no other.
    assert _modules() == {n for n in names if n.endswith(".py")}
    assert "bertforge = bertforge.cluster.cli:main" in scripts


def test_console_script_and_imports_work_beside_a_users_training(installed, tmp_path):
    top_level = {p.name for p in installed.purelib.iterdir()}
    assert {"bertforge", "training"} <= top_level
    assert not {"pipelines", "cluster"} & top_level
    bertforge = installed.root / "bin" / "bertforge"
    # cwd: not the checkout, whose folders would be importable from there.
    help_text = _run([str(bertforge), "--help"], cwd=tmp_path).stdout
    assert "usage: bertforge" in help_text and "submit" in help_text
    probe = ("import bertforge.training.config as config, training; "
             "print(training.MARKER); print(config.__file__)")
    marker, config_file = _run([installed.python, "-c", probe], cwd=tmp_path).stdout.splitlines()
    assert marker == USER_MARKER  # the user's package, untouched by the install
    assert Path(config_file) == installed.purelib / "bertforge" / "training" / "config.py"


@pytest.mark.slow
def test_every_installed_module_imports_without_a_top_level_name(installed, tmp_path):
    """A leftover `import training...` would find the user's package (and fail) or none."""
    probe = """
import importlib, pkgutil, sys
import bertforge
names = [m.name for m in pkgutil.walk_packages(bertforge.__path__, "bertforge.")]
for name in names:
    importlib.import_module(name)
generic = sorted(m for m in sys.modules if m.split(".")[0] in ("pipelines", "training", "cluster"))
print(len(names), generic)
"""
    out = _run([installed.python, "-c", probe], cwd=tmp_path).stdout.splitlines()[-1]
    count, generic = out.split(" ", 1)
    assert int(count) > 40 and generic == "[]"


@pytest.mark.slow
def test_benchmark_runs_from_a_checkout_where_bertforge_is_not_installed(tmp_path):
    """benchmarks/README.md's recipe for the lent GPU box: dependencies only (PYTHONPATH), one
    offline pip step that installs the checkout into a folder, then
    `python3 benchmarks/gpu_throughput.py` from the repository root."""
    venv = _fresh_venv(tmp_path / "venv")
    absent = _run([venv.python, "-c", "import importlib.util; "
                   "print(importlib.util.find_spec('bertforge'))"], cwd=tmp_path).stdout
    assert absent.strip() == "None"
    site_dir = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
          "--no-build-isolation", "--target", str(site_dir), str(_sources(tmp_path / "src"))])
    env = alone_env(PYTHONPATH=str(site_dir))
    _run([venv.python, "benchmarks/gpu_throughput.py", "--device", "cpu", "--config", "tiny",
          "--seq-lens", "64", "--micro-batch", "4", "--steps", "1", "--warmup", "1",
          "--num-batches", "1", "--peak-tflops", "1", "--output-dir", str(tmp_path / "out")],
         cwd=REPO, env=env)
    assert list((tmp_path / "out").glob("gpu_throughput_cpu-*.json"))
