"""A record written whole (`pipelines/contract/durable_files.py`): a pipeline's state file, a
fine-tuning sweep's results."""

from __future__ import annotations

import json
import os
import threading

from bertforge.pipelines.contract.durable_files import write_json_atomic


def test_a_record_is_synced_before_its_name_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """Unsynced, a power loss could leave the record's name on an empty file."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or fsync(fd))
    path = tmp_path / "pipeline.json"
    write_json_atomic(str(path), {"stages": {"vocab": {}}})
    assert os.stat(path).st_ino in synced
    assert os.listdir(tmp_path) == ["pipeline.json"]


def test_two_writers_of_one_record_never_publish_half_of_one(tmp_path):
    """They shared `PATH.tmp`: one truncated it while the other wrote, and the other's rename
    put the half-written file in place (or failed on a temp file already renamed)."""
    path = str(tmp_path / "results.json")
    records = [{"writer": w, "rows": list(range(20_000))} for w in range(2)]
    failures: list[BaseException] = []

    def write(record) -> None:
        try:
            for _ in range(30):
                write_json_atomic(path, record)
                with open(path, encoding="utf-8") as f:
                    assert json.load(f) in records
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    threads = [threading.Thread(target=write, args=(r,)) for r in records]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
