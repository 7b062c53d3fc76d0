"""Records written whole: a reader (a rerun, another process) never sees half of one."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Temp file + rename: a reader never sees half a record."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)
