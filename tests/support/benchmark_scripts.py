"""The scripts in benchmarks/ as modules, for tests that call their functions: they are
scripts, not a package, so each is loaded from its file."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/<name>.py, imported. While in use it is registered in sys.modules (their
    dataclasses look their module up there) and benchmarks/ is on sys.path (they import each
    other, and some put it there themselves); afterwards sys.path is as it was and the
    benchmark modules imported meanwhile are gone, so no other test sees them."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    path_before, modules_before = list(sys.path), set(sys.modules)
    sys.modules[name] = module
    sys.path.insert(0, BENCHMARKS)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = path_before
        for added in set(sys.modules) - modules_before:
            if os.path.dirname(getattr(sys.modules[added], "__file__", None) or "") == BENCHMARKS:
                del sys.modules[added]
