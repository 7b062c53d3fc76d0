"""Fault injection: a Ray Train worker process is SIGKILLed mid-run; the worker group restarts,
resumes from the newest committed checkpoint and ends with the weights of an uninterrupted run."""

import json
import threading
import time

import psutil
import pytest
import torch

from bertforge.cluster.ray_train import LaunchConfig, train_on_ray
from bertforge.training.checkpoint import load_fp32_state_dict
from bertforge.training.config import TrainConfig
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
KILL_AT_STEP = 50


def recipe(data_dir, run_dir) -> TrainConfig:
    return TrainConfig(data_dir=data_dir, run_dir=str(run_dir), model=TINY, max_steps=160,
                       micro_batch_size=8, warmup_steps=5, log_every=1, checkpoint_every=20)


def last_logged_step(run_dir) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def kill_a_worker_after(run_dir, step: int, killed: list) -> None:
    """SIGKILL one training worker process once the run has logged `step`."""
    deadline = time.time() + 300
    while time.time() < deadline and last_logged_step(run_dir) < step:
        time.sleep(0.02)
    for process in psutil.process_iter(["cmdline"]):
        if "RayTrainWorker" in " ".join(process.info["cmdline"] or []):
            killed.append((process.pid, last_logged_step(run_dir)))
            process.kill()
            return


def test_killed_worker_restarts_and_final_weights_equal_uninterrupted_run(tmp_path, capfd):
    import ray

    data = write_dataset(str(tmp_path / "shards"), {"train": [200, 200], "validation": [20]},
                         max_seq_length=64)
    try:
        train_on_ray(recipe(data, tmp_path / "straight"), LaunchConfig(workers=2))
        killed: list = []
        killer = threading.Thread(
            target=kill_a_worker_after, args=(tmp_path / "faulty", KILL_AT_STEP, killed))
        killer.start()
        outcome = train_on_ray(recipe(data, tmp_path / "faulty"),
                               LaunchConfig(workers=2, max_failures=2))
        killer.join()
    finally:
        ray.shutdown()

    assert killed, "no training worker was found to kill"
    pid, step_at_kill = killed[0]
    assert KILL_AT_STEP <= step_at_kill < 160
    output = capfd.readouterr()
    assert "resumed from" in output.out + output.err  # the restarted group continued, not restarted
    assert outcome["step"] == 160
    straight = load_fp32_state_dict(str(tmp_path / "straight/checkpoints/step_00000160"))
    faulty = load_fp32_state_dict(outcome["checkpoint_path"])
    assert all(torch.equal(straight[name], faulty[name]) for name in straight)
