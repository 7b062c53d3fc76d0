"""Paths as the user typed them, made to work where the workers run.

Ray Train's workers do not start in the user's working directory, so a relative `--data shards`
or `--model work/hf` that the driver's checks accepted would fail in every worker after Ray's
start. Each command that hands paths to workers makes them absolute first, in the driver.
"""

from __future__ import annotations

import os
import re


def absolute(path: str | None) -> str | None:
    """A local path, absolute against the current directory; a URI (gs://, s3://, file://) or
    None as it is."""
    if path is None or path == "" or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def stable_name(path: str) -> str:
    """What names a local path across runs of a command: the absolute path, or, inside a
    job's uploaded working directory (`jobs_copy_of`), the path relative to it, so that a
    resubmitted job names its `--run-dir runs/bert` as the first did."""
    path = absolute(path)
    copy = jobs_copy_of(path)
    if copy is not None:
        return "job:" + os.path.relpath(path, copy)
    return path


# Where Ray unpacks a job's uploaded working directory (`submit --working-dir`, Ray's
# runtime_env working_dir): SESSION/runtime_resources/working_dir_files/_ray_pkg_<hash>.
_MARK = "/working_dir_files/_ray_pkg_"
_JOBS_COPY = re.compile(r"(/(?:[^/\s]+/)*working_dir_files/_ray_pkg_[^/\s)'\",:;]+)")


def jobs_copy_of(path: str) -> str | None:
    """The uploaded copy of a job's working directory that `path` lies in, or None: where a
    relative path lands inside a `submit` job. Ray deletes that folder with its session, and
    each submission gets another, so a resubmitted job never sees what an earlier one wrote
    there."""
    path = absolute(path) + "/"
    found = _JOBS_COPY.match(path) if _MARK in path else None
    return found.group(1) if found else None


def refuse_output_in_the_jobs_copy(path: str | None, flag: str) -> None:
    """An output written inside a job's copy of its working directory is lost with it, and a
    resubmitted job's `--resume auto` would find nothing and start over: refused before
    anything runs. (A URI or None passes.)"""
    copy = jobs_copy_of(path) if path and "://" not in path else None
    if copy is not None:
        raise ValueError(
            f"{flag} {path} is inside this job's uploaded copy of its working directory "
            f"({copy}), which Ray deletes and a resubmitted job never sees: give an absolute "
            "path on a filesystem every node mounts (e.g. /shared/runs/NAME)"
            + (", or keep the checkpoints in --storage" if flag == "--run-dir" else ""))


def jobs_copy_hint(message: str) -> str:
    """For an error that names a path in a job's copy of its working directory (a relative
    `--data` found missing there, say): where that path came from; "" for any other."""
    found = _JOBS_COPY.search(message) if _MARK in message else None
    if found is None or "uploaded copy" in message:
        return ""
    return (f" (inside a submitted job a relative path is in the job's uploaded copy of its "
            f"working directory, {found.group(1)}: give absolute paths every node mounts)")
