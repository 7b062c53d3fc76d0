"""Counting host syncs on a CPU: every point where the host reads a tensor's value.

On a GPU such a read (`.item()`, `.tolist()`, `bool(t)`, indexing by a boolean mask, whose
result size is data) waits for every queued kernel; once per micro-step it idles the GPU while
Python catches up. On a CPU nothing waits, so the reads are counted instead: a dispatch mode
sees the ops whose output needs data on the host, a function mode the methods that copy data
out, and each read is charged to the innermost Python frame outside torch (the code that
asked for it), as "training/loop.py:reduce".
"""

from __future__ import annotations

import collections
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Ops whose result the host must read (a scalar) or whose output size is data.
_SYNC_OPS = {
    _aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
}
_SYNC_METHODS = {"tolist", "numpy"}
_TORCH_ROOT = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


class HostSyncCounter:
    """`with counter:` counts reads by site; `counter.sites` maps "path:function" to a count."""

    def __init__(self, root: str) -> None:
        self.root = root  # sites are given relative to it; others by their full path
        self.sites: collections.Counter[str] = collections.Counter()
        self._modes = (_Functions(self), _Dispatch(self))

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def record(self) -> None:
        frame = sys._getframe(2)
        while frame is not None and (
            frame.f_code.co_filename.startswith(_TORCH_ROOT)
            or os.path.abspath(frame.f_code.co_filename) == _HERE
        ):
            frame = frame.f_back
        if frame is None:
            return
        path = frame.f_code.co_filename
        if path.startswith(self.root + os.sep):
            path = os.path.relpath(path, self.root)
        self.sites[f"{path}:{frame.f_code.co_name}"] += 1


class _Functions(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _SYNC_METHODS:
            self.counter.record()
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_OPS or (func is _aten.index.Tensor and _has_bool_index(args)):
            self.counter.record()
        return func(*args, **(kwargs or {}))


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        index is not None and index.dtype in (torch.bool, torch.uint8) for index in indices
    )
