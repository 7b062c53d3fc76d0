"""A dead run's local Ray is cleaned up by the next start (cluster/launch/local_ray.py): its
processes stopped, never those of a live run or of a Ray bertforge did not start; session
folders bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bertforge.cluster.launch.local_ray import KEEP_SESSIONS, reap_dead_runs, running
from tests.support.train_process import TrainProcess, train_command
from tests.training.conftest import write_dataset


def key(process) -> dict:
    process = psutil.Process(process.pid)
    return {"pid": process.pid, "started": process.create_time()}


def write_record(root, name: str, driver: dict, processes: list[dict], session: str) -> str:
    os.makedirs(os.path.join(root, "drivers"), exist_ok=True)
    path = os.path.join(root, "drivers", f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"driver": driver, "session_dir": session, "processes": processes}, f)
    return path


def old_sessions(root, count: int) -> list[str]:
    paths = [os.path.join(root, f"session_2001-01-{day:02d}_00-00-00_000000_1")
             for day in range(1, count + 1)]
    for path in paths:
        os.makedirs(os.path.join(path, "logs"))
    return paths


@pytest.fixture
def sleepers():
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
               for _ in range(3)]
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_only_the_processes_of_dead_drivers_are_stopped(tmp_path, sleepers):
    root = str(tmp_path)
    orphan, live_runs_own, reused = sleepers
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead_driver = {"pid": gone.pid, "started": 1.0}
    sessions = old_sessions(root, KEEP_SESSIONS + 3)
    dead_record = write_record(root, "dead", dead_driver, [key(orphan)], sessions[0])
    # The pid of a recorded process now belongs to another process: never signalled.
    write_record(root, "reused", dead_driver,
                 [{"pid": reused.pid, "started": key(reused)["started"] - 100}], sessions[1])
    # A live driver (this process): its processes and its (oldest) session folder stay.
    live_record = write_record(root, "live", key(psutil.Process()), [key(live_runs_own)],
                               sessions[-1])

    assert reap_dead_runs(root) == [orphan.pid]
    orphan.wait(timeout=10)  # reaped already (psutil waited on it): exited, in any case
    assert live_runs_own.poll() is None and reused.poll() is None
    assert not os.path.exists(dead_record) and os.path.exists(live_record)
    kept = sorted(name for name in os.listdir(root) if name.startswith("session_"))
    # The newest KEEP_SESSIONS (sorted by name: start time) and the live run's.
    assert kept == sorted({os.path.basename(p) for p in sessions[-KEEP_SESSIONS:]}
                          | {os.path.basename(sessions[-1])})


@pytest.mark.slow
def test_a_sigkilled_drivers_ray_is_gone_after_the_next_start(tmp_path):
    data = write_dataset(str(tmp_path / "shards"), {"train": [64], "validation": [8]})
    with TrainProcess(train_command(data, str(tmp_path / "run"))) as run:
        run.wait_until_training()
        tree = run.tree()
        assert any("raylet" in p.name() for p in tree)
        old = old_sessions(run.ray_root, KEEP_SESSIONS + 2)
        workers = [p for p in tree if "RayTrainWo" in p.name()]  # its comm, cut to 15
        assert workers
        run.process.send_signal(signal.SIGKILL)
        run.process.wait(timeout=60)
        # The training workers die with their raylet, which dies with the driver: a process
        # group of their own, they trained on for seconds (till they noticed the raylet gone),
        # committing checkpoints into a run directory no longer locked.
        deadline = time.monotonic() + 0.6  # they noticed it after 0.9 s at the soonest
        while any(map(running, workers)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(map(running, workers)), "the training workers outlived the driver"

        stopped = reap_dead_runs(run.ray_root)  # what the next run's start does first

        assert stopped, "nothing was left to stop: the orphans this cleans up no longer occur?"
        assert not run.survivors(), "left running after the next start's cleanup"
        sessions = [name for name in os.listdir(run.ray_root) if name.startswith("session_2")]
        assert len(sessions) == KEEP_SESSIONS
        assert not any(os.path.basename(path) in sessions for path in old[:3])
        assert os.listdir(os.path.join(run.ray_root, "drivers")) == []
