"""One real local `bertforge train`, watched from outside: nothing listens beyond loopback,
workers included; a second `train` on its run directory is refused before it starts any Ray; a
SIGTERMed driver takes its whole local Ray and its lock with it. (One run serves the three
checks: each Ray start costs tens of seconds of the suite.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from bertforge.cluster.run_lock import LOCK_NAME
from tests.support.train_process import LOOPBACK, TrainProcess, listening_sockets, train_command
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow


def test_a_local_run_listens_on_loopback_only_owns_its_directory_and_leaves_nothing(tmp_path):
    data = write_dataset(str(tmp_path / "shards"), {"train": [64], "validation": [8]})
    run_dir = tmp_path / "run"
    # Two workers: gloo's pair sockets and torch's rendezvous store between them.
    command = train_command(data, str(run_dir), workers=2)
    with TrainProcess(command) as run:
        run.wait_until_training()
        listening = set()
        for _ in range(3):  # a few looks while it trains (workers, agents, actors)
            processes = run.tree()
            listening |= set(listening_sockets(processes))
            time.sleep(1.0)
        names = " ".join(name for name, _, _ in listening)
        assert "RayTrainWorker" in names and "raylet" in names and "gcs_server" in names
        exposed = sorted(entry for entry in listening if entry[1] not in LOOPBACK)
        assert not exposed, f"listening beyond the loopback address: {exposed}"

        second = subprocess.Popen(command, env={**os.environ, "TMPDIR": run.tmpdir},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, stderr = second.communicate(timeout=300)
        assert second.returncode == 2, stderr
        assert (f"another bertforge train is running in {run_dir} (host "
                f"{socket.gethostname()}, pid {run.process.pid}, since 20") in stderr
        # Refused before Ray started: no session of its own (Ray names them ..._PID).
        assert not [name for name in os.listdir(run.ray_root) if name.endswith(f"_{second.pid}")]

        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(timeout=120) != 0
        assert not run.survivors(), "left running after SIGTERM"
    assert not (run_dir / LOCK_NAME).exists(), "the lock outlived a SIGTERMed run"
