"""reap_dead_runs (cluster/launch/local_ray.py) leaves alone the records, processes and session
folders of runs in another container or on another node that share this TMPDIR: their pids are not
this process table's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil

from bertforge.cluster.launch.local_ray import reap_dead_runs
from bertforge.cluster.safety.run_lock import process_scope


def write_record(root, name: str, scope: dict, driver: dict, processes: list[dict],
                 session: str) -> str:
    os.makedirs(os.path.join(root, "drivers"), exist_ok=True)
    path = os.path.join(root, "drivers", f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"scope": scope, "driver": driver, "session_dir": session,
                   "processes": processes}, f)
    return path


def test_a_foreign_record_is_not_reaped_and_its_session_is_kept(tmp_path):
    root = str(tmp_path)
    sessions = [os.path.join(root, f"session_2001-01-{day:02d}_00-00-00_000000_1")
                for day in range(1, 4)]
    for path in sessions:
        os.makedirs(path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead_driver = {"pid": gone.pid, "started": 1.0}  # no such process here
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sleeper_key = {"pid": sleeper.pid, "started": psutil.Process(sleeper.pid).create_time()}
        foreign = write_record(root, "foreign", {**process_scope(), "boot_id": "another-node"},
                               dead_driver, [sleeper_key], sessions[0])
        ours = write_record(root, "ours", process_scope(), dead_driver, [], sessions[1])
        assert reap_dead_runs(root, keep_sessions=0) == []
        assert sleeper.poll() is None  # a pid of another process table: never signalled
        assert os.path.exists(foreign) and not os.path.exists(ours)
        assert sorted(os.listdir(root)) == ["drivers", os.path.basename(sessions[0])]
    finally:
        sleeper.kill()
        sleeper.wait()
