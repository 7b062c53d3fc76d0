"""Files on the disk before anything vouches for them, and records written whole.

Without Beam or torch, so that prepare's local runner, the checkpoints and the command line's
records share one way of doing it: a power loss can keep a new file's name and lose its bytes
(ext4's and XFS's delayed allocation write the data after the name), so a file is synced before
the marker, manifest or record that says it is done, and a record is renamed into place whole.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any


def fsync_path(path: str) -> None:
    """`path`'s bytes (or, for a folder, its entries) on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, data: Any, *, indent: int | None = 2) -> None:
    """Temp file + rename: a reader never sees half a record. The temp file's name is its
    writer's own (two writers of one record shared `PATH.tmp`, and one renamed the other's
    half-written file into place), and its bytes are synced before the rename: a power loss
    left the new name on an empty file (a pipeline's state, which says what stages are done)."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
