"""Which disk filled: the errors a failure was raised from, and the room on the disks written to.

In the contract, without Beam or torch, because prepare's local runner (pipelines), training's
error handling and fine-tuning's (cluster) each name the disk that filled, and each had its own
walk of an error's chain or its own look for the fullest folder.
"""

from __future__ import annotations

import os
import shutil


def exception_chain(error: BaseException) -> list[BaseException]:
    """`error` and those it was raised from or during, each once. A chain can loop: Ray's
    failed start (its dashboard, on a full TMPDIR) raised an error that is its own cause, and
    walking it without this check spun for ever in the command's error handler, with no word."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and all(seen is not earlier for earlier in chain):
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def nearest_existing(path: str) -> str:
    """`path`, or its nearest folder that exists (a file the failure removed, a folder never
    made)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path or "/"


def free_bytes(path: str) -> int:
    """The room left on `path`'s disk; a disk that cannot be asked counts as roomy."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return 2**63


def fullest_of(*paths: str) -> str:
    """Of the folders a command writes to, the one on the disk with the least room (the one
    that filled); the first of equals."""
    return min(paths, key=free_bytes)
