"""What the demo and the pipeline share: one run per directory, progress while a stage works,
fresh output directories and atomic JSON records."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LOCK_NAME = ".lock"


@contextmanager
def exclusive_directory(root: str, command: str) -> Iterator[None]:
    """One run per directory at a time: a second concurrent run is refused, not interleaved.

    flock is released by the kernel when the process dies, so a crash never leaves it stuck.
    """
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, LOCK_NAME), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another bertforge {command} is running in {root}") from None
        yield


@contextmanager
def heartbeat(command: str, label: str, every_seconds: float) -> Iterator[None]:
    """A line every `every_seconds` while a stage works, so a long step never looks hung."""
    stop = threading.Event()
    started = time.time()

    def beat() -> None:
        while not stop.wait(every_seconds):
            print(f"[{command}] {label}: still working ({time.time() - started:.0f} s)",
                  flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fresh_dir(path: str) -> None:
    """An empty directory: a stage that died part-way leaves files that cannot be trusted."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Temp file + rename: a reader never sees half a record."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)
