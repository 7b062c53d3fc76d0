"""A bertforge checkout (a clone of this repository) and the package setuptools builds from it.

`bertforge submit --working-dir CHECKOUT` ships the checkout's code as the package `bertforge`;
these are its two questions: is a directory bertforge's own sources, and what is the package
built from them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (pyproject.toml installs tomli there)
    import tomli as tomllib


def package_folders(root: str) -> tuple[str, ...] | None:
    """The folders installed as `bertforge.<folder>` when `root` is a bertforge checkout (its
    pyproject.toml names the distribution `bertforge` and lists them), else None: a project of
    the user's own with a `training/` folder is not one."""
    try:
        with open(os.path.join(root, "pyproject.toml"), "rb") as f:
            project = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if project.get("project", {}).get("name") != "bertforge":
        return None
    folders = project.get("tool", {}).get("bertforge", {}).get("package-folders")
    return tuple(folders) if folders else None


@contextlib.contextmanager
def built_package(root: str) -> Iterator[str]:
    """The checkout's package as a wheel holds it (setup.py's layout: `bertforge/training/...`,
    package data included, nothing else), in a temporary `bertforge/` that lives as long as
    the context. setuptools writes its metadata there too, not into the checkout."""
    with tempfile.TemporaryDirectory(prefix="bertforge-submit-") as tmp:
        done = subprocess.run(
            [sys.executable, "setup.py", "--quiet", "egg_info", "--egg-base", tmp,
             "build_py", "--build-lib", tmp],
            cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the package of {root} failed:\n{done.stderr[-3000:]}")
        yield os.path.join(tmp, "bertforge")
