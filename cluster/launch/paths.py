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
    here = os.getcwd()
    if os.environ.get(UPLOADED_WORKING_DIR_ENV) and path.startswith(here + os.sep):
        return "job:" + os.path.relpath(path, here)
    return path
