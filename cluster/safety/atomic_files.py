"""Records written whole: a reader (a rerun, another process) never sees half of one."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Temp file + rename: a reader never sees half a record. The temp file's name is its
    writer's own (two writers of one record shared `PATH.tmp`, and one renamed the other's
    half-written file into place), and its bytes are synced before the rename: a power loss
    left the new name on an empty file (a pipeline's state, which says what stages are done)."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
