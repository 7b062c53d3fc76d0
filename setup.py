"""Installs the top-level folders as sub-packages of `bertforge` (metadata is in pyproject.toml).

`pipelines/`, `training/` and `cluster/` (pyproject's `[tool.bertforge] package-folders`) stay
at the top of the repository, but nothing generic may land at the top of site-packages, where
`training` would shadow (or be shadowed by) a user's own `training/`. `bertforge` itself is a
namespace package: it has no `__init__.py`, so the repository needs no folder of that name.

A wheel holds `bertforge/training/...` as files. The editable install (scripts/install.sh) is
setuptools' strict mode: `build/__editable__.*/bertforge/` mirrors the same tree with a link per
file, and a `.pth` file puts it on `sys.path`, so Python, mypy, pyright and IDEs all find
`bertforge.training` as a plain directory (no import hook). A link per file: an edit shows at
once, a new or renamed file needs the install again (`make install` notices).
"""

import os

import setuptools

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: setuptools (>= 71) makes its own copy importable
    import tomli as tomllib

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyproject.toml"), "rb") as f:
    FOLDERS = tomllib.load(f)["tool"]["bertforge"]["package-folders"]

setuptools.setup(
    packages=[
        f"bertforge.{name}"
        for name in setuptools.find_packages(include=[f"{folder}{tail}" for folder in FOLDERS
                                                      for tail in ("", ".*")])
    ],
    package_dir={f"bertforge.{folder}": folder for folder in FOLDERS},
    # The SST-2 subset the demo fine-tunes on (cluster/demo/data/sst2/SOURCE.md).
    package_data={"bertforge.cluster.demo": ["data/sst2/*.tsv", "data/sst2/*.md"]},
)
