"""Paths as the user typed them, made to work where the workers run.

Ray Train's workers do not start in the user's working directory, so a relative `--data shards`
or `--model work/hf` that the driver's checks accepted would fail in every worker after Ray's
start. Each command that hands paths to workers makes them absolute first, in the driver.
"""

from __future__ import annotations

import os


def absolute(path: str | None) -> str | None:
    """A local path, absolute against the current directory; a URI (gs://, s3://, file://) or
    None as it is."""
    if path is None or path == "" or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


# Set by `bertforge submit` in the job's environment: the job runs in the working directory it
# uploaded, which is another one at each submission.
UPLOADED_WORKING_DIR_ENV = "BERTFORGE_UPLOADED_WORKING_DIR"


def stable_name(path: str) -> str:
    """What names a local path across runs of a command: the absolute path, or, inside a
    `submit` job, a path under the job's uploaded working directory relative to it (so that
    a resubmitted job names its `--run-dir runs/bert` as the first did)."""
    path = absolute(path)
    if in_the_jobs_copy(path):
        return "job:" + os.path.relpath(path, os.getcwd())
    return path


def in_the_jobs_copy(path: str) -> bool:
    """Inside a `submit` job: `path` is in the job's uploaded copy of the working directory
    (where a relative path lands), a folder in Ray's session directory that Ray deletes and
    that a resubmitted job never sees (it gets a new one)."""
    return bool(os.environ.get(UPLOADED_WORKING_DIR_ENV)) and (
        absolute(path) + os.sep).startswith(os.getcwd() + os.sep)


def refuse_output_in_the_jobs_copy(path: str, flag: str) -> None:
    """An output written inside the job's copy is lost with it, and a resubmitted job's
    `--resume auto` would find nothing and start over: refused before anything runs."""
    if in_the_jobs_copy(path):
        raise ValueError(
            f"{flag} {path} is inside this job's uploaded copy of the working directory "
            f"({os.getcwd()}), which Ray deletes and a resubmitted job never sees: give an "
            "absolute path on a filesystem every node mounts (e.g. /shared/runs/NAME)"
            + (", or keep the checkpoints in --storage" if flag == "--run-dir" else ""))


def jobs_copy_hint(message: str) -> str:
    """Inside a `submit` job, an error that names a path in the job's copy of the working
    directory (a relative `--data`, say, found missing there) says where that path came
    from; elsewhere "" ."""
    here = os.getcwd()
    if not os.environ.get(UPLOADED_WORKING_DIR_ENV) or here + os.sep not in message:
        return ""
    return (f" (inside a submitted job a relative path is in the job's uploaded copy of the "
            f"working directory, {here}: give absolute paths every node mounts)")
