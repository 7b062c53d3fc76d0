"""Nothing listens beyond loopback during a local `bertforge train`, workers included, and a
SIGTERMed driver takes its whole local Ray with it."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.train_process import LOOPBACK, TrainProcess, listening_sockets, train_command
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow


def test_a_local_run_listens_on_loopback_only_and_leaves_nothing_after_sigterm(tmp_path):
    data = write_dataset(str(tmp_path / "shards"), {"train": [64], "validation": [8]})
    # Two workers: gloo's pair sockets and torch's rendezvous store between them.
    with TrainProcess(train_command(data, str(tmp_path / "run"), workers=2)) as run:
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

        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(timeout=120) != 0
        assert not run.survivors(), "left running after SIGTERM"
