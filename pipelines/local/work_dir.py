"""The local runner's work directory: what is done, on disk, so a killed run continues.

    WORK/job.json                      what the run is (the job's identity and the runner's cut)
    WORK/<stage>/b000017.json          bundle 17 of a stage is done: its output files, metrics
    WORK/<stage>/b000017.<n>.list|run*  its output data (`pipelines.local.spill`)
    WORK/<stage>/stage.json            every bundle of the stage is done

A marker is written (atomically, after its data files are on disk) only once what it describes
is complete, so whatever a `kill -9` interrupts has no marker and is done again. A rerun with
another identity (other inputs, settings or code) is refused, naming what differs, unless it is
asked to start over: bundles of another job must never be mixed into this one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
from typing import Any

from bertforge.pipelines.contract.durable_files import write_json_atomic

# Its name inside prepare's output directory (free of Beam: `train` checks for it too).
WORK_DIR_NAME = ".prepare-work"
JOB_FILE = "job.json"
STAGE_FILE = "stage.json"


class WorkConflict(ValueError):
    """The work directory holds an unfinished run of another job: a user error, one line."""


class WorkIncomplete(ValueError):
    """A file the work directory's records name is gone (removed by hand, another disk state)."""


class WorkDir:
    def __init__(self, root: str, identity: dict[str, Any]):
        self.root = root
        self.identity = json.loads(json.dumps(identity, sort_keys=True))  # as JSON reads back

    def open(self, start_over: bool = False) -> bool:
        """Claim the directory; True when it holds work of this same job to continue."""
        path = os.path.join(self.root, JOB_FILE)
        if os.path.isfile(path) and not start_over:
            with open(path, encoding="utf-8") as f:
                found = json.load(f)
            differences = identity_differences(found, self.identity)
            if differences:
                raise WorkConflict(
                    f"{self.root} holds an unfinished run of another job (differs in: "
                    f"{'; '.join(differences)})")
            return True
        self.discard()
        os.makedirs(self.root)
        write_json_atomic(path, self.identity, indent=None)
        return False

    def stage(self, label: str, step_names: list[str]) -> StageDir:
        return StageDir(os.path.join(self.root, stage_dir_name(label, step_names)))

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def identity_differences(found: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return [_difference(key, found.get(key), wanted.get(key))
            for key in sorted(set(found) | set(wanted)) if found.get(key) != wanted.get(key)]


def _difference(key: str, before: Any, after: Any, most: int = 3) -> str:
    """A key's change. Of a list of records named by their first item (the inputs: [path,
    size, time]), only the records that changed: one file touched in a corpus of thousands
    named every file, twice, and hid which one it was."""
    if not (_named_records(before) and _named_records(after)):
        return f"{key} {before!r} -> {after!r}"
    was, now = {r[0]: r[1:] for r in before}, {r[0]: r[1:] for r in after}
    changed = [f"{name} {was.get(name, 'absent')} -> {now.get(name, 'absent')}"
               for name in sorted(was.keys() | now.keys(), key=str)
               if was.get(name) != now.get(name)]
    more = f" and {len(changed) - most} more" if len(changed) > most else ""
    return f"{key} {', '.join(changed[:most]) or 'the same, in another order'}{more}"


def _named_records(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(r, list) and r and isinstance(r[0], str) for r in value)


def stage_dir_name(label: str, step_names: list[str]) -> str:
    """The stage's label and a digest of its steps' names, which every run of the job gives the
    same way (Beam's own stage names join the steps in a per-process hash order)."""
    digest = hashlib.sha1("\n".join(sorted(step_names)).encode("utf-8")).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9]+', '-', label)[:40]}-{digest}"


class StageDir:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, exist_ok=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def bundle_prefix(self, index: int) -> str:
        return self.file(f"b{index:06d}")

    def done_bundle(self, index: int) -> dict | None:
        return read_json(self.bundle_prefix(index) + ".json")

    def commit_bundle(self, index: int, record: dict) -> None:
        write_json_atomic(self.bundle_prefix(index) + ".json", record, indent=None)

    def completed(self) -> dict | None:
        return read_json(self.file(STAGE_FILE))

    def commit(self, record: dict) -> None:
        write_json_atomic(self.file(STAGE_FILE), record, indent=None)


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_bytes(text: str) -> bytes:
    return base64.b64decode(text)


def read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
