"""The `pymp-*` folders a local Ray leaves in the temporary directory, removed once it stops.

Ray's dashboard starts its modules through multiprocessing's forkserver (Ray 2.60 on POSIX),
which listens on a unix socket in a `pymp-*` folder of its own. The dashboard is stopped
without running its exit handlers, so each local Ray left one folder and a dead socket behind
(584 of them on one machine after a few days of tests). A folder is removed only when it
appeared while this run's Ray ran, is ours, and holds nothing but sockets no process has open:
never a live process's, nor another program's files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile

PREFIX = "pymp-"


def present() -> set[str]:
    """The `pymp-*` folders in the temporary directory now."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        return {os.path.join(root, name) for name in os.listdir(root)
                if name.startswith(PREFIX)}
    return set()


def remove_dead(since: set[str]) -> list[str]:
    """Remove the folders not in `since` (what `present()` saw before the Ray started) that
    hold only sockets no process has open; returns those removed. Where the kernel does not
    list its unix sockets (no /proc: not Linux), nothing is removed."""
    bound = _bound_socket_paths()
    removed = []
    for path in sorted(present() - since):
        if bound is not None and _owned_and_dead(path, bound):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _bound_socket_paths() -> set[str] | None:
    """The paths of the unix sockets some process of this network namespace holds, from
    /proc/net/unix (no connection is made: a forkserver that is connected to and hung up on
    would take it for a broken request)."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as table:
            next(table)  # the header
            return {fields[7] for fields in map(str.split, table) if len(fields) > 7}
    except (OSError, StopIteration):
        return None


def _owned_and_dead(path: str, bound: set[str]) -> bool:
    try:
        if os.lstat(path).st_uid != os.getuid():
            return False
        entries = [os.path.join(path, name) for name in os.listdir(path)]
        # An empty folder may be a live process's that is about to bind its socket there.
        return bool(entries) and all(
            stat.S_ISSOCK(os.lstat(entry).st_mode) and entry not in bound for entry in entries)
    except OSError:  # gone meanwhile, or not ours to read
        return False
