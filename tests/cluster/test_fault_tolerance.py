"""Fault injection: a Ray Train worker process is SIGKILLed mid-run; the worker group restarts,
resumes from the newest committed checkpoint and ends with the weights of an uninterrupted run.
Twice in one run: from the run directory, then from Ray Train storage with the node's local
copies gone. A user error inside a worker, on the other hand, ends the run after one attempt.
(One local Ray serves the module, and the uninterrupted run is the same loop without Ray: each
Ray start and Ray Train worker group costs tens of seconds of the suite.)"""

import contextlib
import dataclasses
import json
import os
import shutil
import threading
import time

import psutil
import pytest
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from bertforge.cluster.launch.failure_policy import user_errors_fail_at_once
from bertforge.cluster.launch.ray_train import LaunchConfig, connect, train_on_ray
from bertforge.training.checkpoint import (
    checkpoint_run_id,
    committed_steps,
    latest_checkpoint,
    load_fp32_state_dict,
    read_metadata,
)
from bertforge.training.config import TrainConfig
from bertforge.training.errors import UserInputError
from tests.training.conftest import write_dataset
from tests.training.test_elastic_resume import run_on

pytestmark = pytest.mark.slow

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
# Checkpoints at 10, 20, ...: each kill lands after a checkpoint and well before the last step,
# so each restarted group resumes mid-run (a few seconds of training each way, not minutes).
MAX_STEPS = 60
FIRST_KILL_AT_STEP = 25
SECOND_KILL_AT_STEP = 45


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """The first run starts this process's local Ray (`connect`); the others join it."""
    yield
    ray.shutdown()


def recipe(data_dir, run_dir) -> TrainConfig:
    return TrainConfig(data_dir=data_dir, run_dir=str(run_dir), model=TINY, max_steps=MAX_STEPS,
                       micro_batch_size=8, warmup_steps=5, log_every=1, checkpoint_every=10)


def last_logged_step(run_dir) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def kill_a_worker_after(run_dir, step: int, killed: list) -> None:
    """SIGKILL one training worker process of this process's own local Ray (its raylet is our
    child) once the run has logged `step`: never a worker of another run on the machine."""
    deadline = time.time() + 300
    while time.time() < deadline and last_logged_step(run_dir) < step:
        time.sleep(0.02)
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "RayTrainWorker" not in " ".join(process.cmdline()):
                continue
            killed.append((process.pid, last_logged_step(run_dir)))
            process.kill()
            return


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(data dir, final fp32 weights) of the run without faults: the same loop in a plain
    2-process gloo group, one thread each as on Ray (tests/training), which starts in seconds
    where a Ray Train worker group takes tens."""
    root = tmp_path_factory.mktemp("uninterrupted")
    data = write_dataset(str(root / "shards"), {"train": [200, 200], "validation": [20]},
                         max_seq_length=64)
    cfg = recipe(data, root / "straight")
    run_on(2, cfg)
    final = latest_checkpoint(cfg.run_dir)
    assert read_metadata(final)["global_step"] == MAX_STEPS
    return data, load_fp32_state_dict(final)


def run_with_a_fault(run_dir, launch: LaunchConfig, inject, data: str, *,
                     resume: bool = True) -> tuple[dict, list]:
    """Train with `inject(run_dir, killed)` running beside it; (outcome, [(pid, step)])."""
    killed: list = []
    killer = threading.Thread(target=inject, args=(run_dir, killed))
    killer.start()
    try:
        outcome = train_on_ray(dataclasses.replace(recipe(data, run_dir), resume=resume), launch)
    finally:
        killer.join()
    return outcome, killed


def kill_a_worker_then_another_and_lose_local_checkpoints(run_dir, killed: list) -> None:
    kill_a_worker_after(run_dir, FIRST_KILL_AT_STEP, killed)
    kill_a_worker_after(run_dir, SECOND_KILL_AT_STEP, killed)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the node's disk is gone


def same_weights(expected: dict, checkpoint_path: str) -> bool:
    actual = load_fp32_state_dict(checkpoint_path)
    return all(torch.equal(expected[name], actual[name]) for name in expected)


def test_killed_workers_restart_from_local_then_from_storage_and_end_with_the_same_weights(
        uninterrupted, tmp_path, capfd):
    """Checkpoints persisted through Ray Train storage (cluster/launch/persistence.py). The first
    worker dies: the group restarts from the run directory's checkpoint. The second dies and
    its node's copy of the checkpoints is lost with it: the group restores from storage. The
    final weights are those of the run without faults, bit for bit.

    A new run (--resume never) over an earlier run's checkpoints: they are moved aside once,
    and the restarted groups continue the new run (they used to move its own checkpoints
    aside as well and train it from step 0 again)."""
    data, straight = uninterrupted
    earlier = tmp_path / "faulty" / "checkpoints"
    shutil.copytree(os.path.join(os.path.dirname(data), "straight", "checkpoints"), earlier)
    launch = LaunchConfig(workers=2, max_failures=2, storage=str(tmp_path / "storage"))
    outcome, killed = run_with_a_fault(
        tmp_path / "faulty", launch, kill_a_worker_then_another_and_lose_local_checkpoints, data,
        resume=False)
    assert len(killed) == 2, f"a training worker to kill was not found: {killed}"
    assert FIRST_KILL_AT_STEP <= killed[0][1] < SECOND_KILL_AT_STEP <= killed[1][1] < MAX_STEPS
    output = capfd.readouterr()
    console = output.out + output.err
    # Both restarted groups continued, not started over: the first from the run directory's
    # checkpoint, the second from the copy it restored from storage (once: the first had the
    # local copy, as new as storage's).
    assert console.count("[train] resumed from") >= 2, console
    assert console.count("[train] restored step") == 1, console
    assert outcome["step"] == MAX_STEPS
    assert outcome["checkpoint_path"].startswith(str(tmp_path / "storage"))
    # The run, as without --storage (the summary had no run_id with it).
    assert outcome["run_id"] == checkpoint_run_id(outcome["checkpoint_path"]) is not None
    assert same_weights(straight, outcome["checkpoint_path"])
    moved = os.listdir(tmp_path / "faulty" / "previous")
    assert len(moved) == 1 and console.count("(--resume never)") == 1, console
    assert committed_steps(str(tmp_path / "faulty" / "previous" / moved[0])) == [50, 60]
    # Another new run over it would have Ray Train prune this one's checkpoints in storage.
    with pytest.raises(UserInputError, match=r"--resume never: .*storage holds an earlier "
                       r"run of .*faulty \(\d+ checkpoint\(s\), newest step_00000060\)"):
        train_on_ray(dataclasses.replace(recipe(data, tmp_path / "faulty"), resume=False),
                     launch)


def fit_failing(tmp_path, name: str, error: Exception, max_failures: int) -> None:
    """Fit a one-worker trainer whose every attempt logs itself (in NAME.attempts) and raises
    `error`."""
    log = tmp_path / f"{name}.attempts"
    log.touch()

    def fails(config):  # nested: shipped to the worker by value
        with open(config["log"], "a", encoding="utf-8") as f:
            f.write("attempt\n")
        raise config["error"]

    trainer = TorchTrainer(
        fails, train_loop_config={"log": str(log), "error": error},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(tmp_path),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    with user_errors_fail_at_once():
        trainer.fit()


def test_user_error_in_a_worker_ends_the_run_after_one_attempt(tmp_path):
    connect(LaunchConfig(workers=1))  # joins the module's local Ray (starts it if first)
    message = "shard /data/train/part-00001.arrow row 17 is corrupt: token id 65533"
    with pytest.raises(UserInputError, match="row 17 is corrupt") as caught:
        fit_failing(tmp_path, "user", UserInputError(message), max_failures=3)
    assert len((tmp_path / "user.attempts").read_text().splitlines()) == 1  # not 4
    assert str(caught.value) == message  # the command line prints this one line


def test_workers_killed_for_memory_end_the_run_with_one_line():
    """Ray's memory monitor killing the workers (and the controller) ended `train` with Ray's
    traceback of some 40 lines. The message is Ray 2.60's, as a 2-worker BERT-large run on a
    24 GB machine gave it."""
    import ray.exceptions
    from ray.train.v2.api.exceptions import ControllerError

    killed = ray.exceptions.OutOfMemoryError(
        "3 worker(s) were killed due to the node running low on memory. Memory on the node "
        "(IP: 127.0.0.1, ID: 052ede62f013e61edef0d95c79b5448a2f3135027f11299804469a2e) was "
        "22.47GB used / 23.54GB limit (0.954627)\nTop 10 memory users: ...")
    with pytest.raises(UserInputError) as caught, user_errors_fail_at_once():
        raise ControllerError(killed)
    assert str(caught.value).startswith(
        "Ray stopped the run: the node ran low on memory (22.47GB used / 23.54GB limit)")
    assert "\n" not in str(caught.value)
    with pytest.raises(ControllerError), user_errors_fail_at_once():  # anything else: as it was
        raise ControllerError(RuntimeError("the controller failed"))
