"""The same training on a two-node Ray cluster started on this machine: `ray start --head`
plus a second `ray start --address`, each node on its own loopback address with one CPU."""

import os
import subprocess
import sys

import pytest

from bertforge.training.checkpoint import latest_checkpoint, read_metadata
from bertforge.training.metrics import read_metrics
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_training_spans_two_nodes_through_a_submitted_job(two_node_cluster, tmp_path):
    data = write_dataset(str(tmp_path / "shards"), {"train": [80, 80], "validation": [16]},
                         max_seq_length=64)
    run_dir = tmp_path / "run"
    # Each node offers 1 CPU and each worker takes 1: the two workers must sit on different
    # nodes, so the gradients cross between raylets (gloo over 127.0.0.2 <-> 127.0.0.3).
    command = [
        sys.executable, "-m", "bertforge.cluster.cli", "submit", "--address",
        two_node_cluster.dashboard_url, "--working-dir", REPO, "--",
        "python", "-m", "bertforge.cluster.cli", "train", "--address", "auto", "--data", data,
        "--run-dir", str(run_dir), "--steps", "12", "--workers", "2", "--cpus-per-worker", "1",
        "--batch-size", "8", "--warmup-steps", "2", "--checkpoint-every", "6",
    ]
    # This process imported Ray without the token mode; the client of a fresh one needs it.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=480)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "SUCCEEDED" in result.stdout
    final = latest_checkpoint(str(run_dir))
    assert read_metadata(final)["global_step"] == 12
    assert read_metadata(final)["world_size"] == 2
    history = read_metrics(str(run_dir))
    assert history[-1]["step"] == 12 and history[-1]["loss"] < history[0]["loss"]
