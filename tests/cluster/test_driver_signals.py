"""driver_teardown (cluster/local_ray.py) turns SIGTERM/SIGHUP/SIGINT into a clean stop only
where they would end the process anyway: a SIGHUP that `nohup` ignores stays ignored. A real
`bertforge train` stopped by SIGTERM exits 143 with one line and resumes."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bertforge.cluster.local_ray import driver_teardown
from bertforge.training.checkpoint import COMMIT_MARKER
from tests.training.conftest import write_dataset


def test_ignored_sighup_stays_ignored_and_default_sigterm_is_handled_then_restored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with driver_teardown():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
        signal.signal(signal.SIGTERM, previous_term)


def test_a_signal_is_a_stop_however_ray_surfaces_it(monkeypatch):
    from bertforge.cluster import local_ray

    monkeypatch.setattr(local_ray, "_RECEIVED", [])
    assert local_ray.as_stop(SystemExit(0)) is None and local_ray.as_stop(SystemExit(1)) is None
    # ray.init's own handler, before ours is back: sys.exit(15)
    assert local_ray.as_stop(SystemExit(15)).code == 143
    # Ours, raised inside ray.get's C++ wait, comes out as Ray's SystemExit(1).
    local_ray._RECEIVED.append(signal.SIGINT)
    stop = local_ray.as_stop(SystemExit(1))
    assert stop.code == 130 and stop.describe() == "stopped by SIGINT"


@pytest.mark.slow
def test_sigterm_stops_train_cleanly_and_the_same_command_resumes(tmp_path):
    """What a scheduler, `timeout` or `docker stop` does: exit 143 with one line naming the
    newest committed checkpoint, the lock released, Ray and its workers gone; then a rerun
    resumes from that checkpoint. Both with relative --data and --run-dir."""
    data = write_dataset(str(tmp_path / "data"), {"train": [300, 300], "validation": [16]},
                         max_seq_length=64)
    run_dir = tmp_path / "run"
    # Relative paths, as anyone types them: they are the user's directory's, not the workers'.
    command = [os.path.join(os.path.dirname(sys.executable), "bertforge"), "train",
               "--data", os.path.relpath(data, tmp_path), "--run-dir", "run", "--preset", "tiny",
               "--workers", "1", "--precision", "fp32", "--checkpoint-every", "10",
               "--steps", "100000"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path)
    first = run_dir / "checkpoints" / "step_00000010" / COMMIT_MARKER
    while not first.exists():
        assert process.poll() is None, process.communicate()
        time.sleep(0.2)
    children = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("bertforge train: stopped by SIGTERM; newest committed checkpoint "
                           f"{run_dir / 'checkpoints'}/step_"), err
    assert "Traceback" not in err and "SIGTERM received" not in err
    assert not (run_dir / ".lock").exists()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.name() for p in alive]
    newest = last.split("newest committed checkpoint ")[1].split(";")[0]

    resumed = subprocess.run(command[:-1] + [str(int(newest.rsplit("_", 1)[1]) + 2)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"[train] resumed from {newest}" in resumed.stdout
