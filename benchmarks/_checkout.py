"""`import _checkout` gives a benchmark this checkout's `bertforge` (when the package is not
installed) and its test helpers (`tests.support`), without putting the repository root on
`sys.path`, where its folders would be importable as `training`, `cluster`, ...

Benchmarks run from a checkout, also where nothing is installed (the lent GPU box: torch and
DeepSpeed on PYTHONPATH, no `make install`). The checkout holds `pipelines/`, `training/` and
`cluster/`, which setup.py installs as `bertforge.pipelines`, ... (package-dir); no folder is
named `bertforge`. So when `import bertforge` finds nothing, a `bertforge` package is registered
whose `__path__` is the repository root: `bertforge.training` is then `REPO/training`, under the
same names as installed. An installed bertforge (editable or not) is left as it is. Only this
process sees the registration: child processes that import bertforge (Ray workers, Beam's
multi-processing workers) need the installed package, while the `deepspeed` launcher's ranks
run the script again and so import this module themselves.

Benchmarks find this module as a sibling: `python benchmarks/NAME.py` puts `benchmarks/` first
on `sys.path`.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_package(name: str, folder: str) -> types.ModuleType:
    """Imports `folder` as the package `name` (kept if `name` is imported already)."""
    if name in sys.modules:
        return sys.modules[name]
    init = os.path.join(folder, "__init__.py")
    if os.path.isfile(init):
        spec = importlib.util.spec_from_file_location(name, init,
                                                      submodule_search_locations=[folder])
    else:  # like a namespace package: a __path__ and nothing to run
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [folder]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)
    return module


if importlib.util.find_spec("bertforge") is None:
    checkout_package("bertforge", REPO)
# Always this checkout's: an unrelated top-level `tests` is often installed in site-packages.
checkout_package("tests", os.path.join(REPO, "tests"))
