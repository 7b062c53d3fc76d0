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
