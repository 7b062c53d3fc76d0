"""Installs the top-level folders as sub-packages of `bertforge` (metadata is in pyproject.toml).

`pipelines/`, `training/` and `cluster/` stay at the top of the repository, but nothing generic
may land at the top of site-packages, where `training` would shadow (or be shadowed by) a user's
own `training/`. `bertforge` itself is a namespace package: it has no `__init__.py`, so the
repository needs no folder of that name.
"""

from setuptools import find_packages, setup

FOLDERS = ("pipelines", "training", "cluster")

setup(
    packages=[
        f"bertforge.{name}"
        for name in find_packages(include=[f"{folder}{tail}" for folder in FOLDERS
                                           for tail in ("", ".*")])
    ],
    package_dir={f"bertforge.{folder}": folder for folder in FOLDERS},
    # The SST-2 subset the demo fine-tunes on (cluster/demo/data/sst2/SOURCE.md).
    package_data={"bertforge.cluster.demo": ["data/sst2/*.tsv", "data/sst2/*.md"]},
)
