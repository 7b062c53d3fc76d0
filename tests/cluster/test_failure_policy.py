"""A user error inside a worker ends the run after one attempt; any other worker error is still
retried up to max_failures (the policy's decisions; a real Ray Train run of a user error is in
test_fault_tolerance, on that module's local Ray)."""

from __future__ import annotations

import pytest
from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

from bertforge.cluster.launch.failure_policy import UserErrorsFailAtOnce
from bertforge.training.errors import UserInputError


def test_other_worker_errors_are_still_retried():
    """Ray's own decisions for everything else (a real run of that costs a minute here)."""
    policy = UserErrorsFailAtOnce(FailureConfig(max_failures=1))
    crash = WorkerGroupError("rank 0 died", {0: RuntimeError("worker crashed")})
    assert policy.make_decision(crash) == FailureDecision.RETRY
    assert policy.make_decision(crash) == FailureDecision.RAISE  # max_failures used up
    user = WorkerGroupError("rank 1", {0: RuntimeError("peer gone"), 1: UserInputError("bad")})
    assert UserErrorsFailAtOnce(FailureConfig(max_failures=5)).make_decision(user) == (
        FailureDecision.RAISE)


def test_gpu_workers_a_local_machine_lacks_are_refused_before_ray_starts(monkeypatch):
    import ray

    from bertforge.cluster.launch import ray_train
    from bertforge.cluster.launch.ray_train import LaunchConfig, check_local_resources, connect

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    check_local_resources(LaunchConfig(workers=1, gpu=True))
    check_local_resources(LaunchConfig(workers=8, gpu=True, address="auto"))  # the cluster's
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_train.local_ray, "start", pytest.fail)  # never reached
    with pytest.raises(UserInputError, match=r"--gpu asks for one GPU per worker \(8\), and "
                                             r"this machine has 1; drop --gpu"):
        connect(LaunchConfig(workers=8, gpu=True))


def test_a_refused_gpu_run_leaves_nothing(monkeypatch, tmp_path):
    """The fault table's promise: `train --gpu` on a machine without the GPUs makes no run
    directory (no logs/train.log either), and the dataset is not even opened."""
    from bertforge.cluster.launch.ray_train import LaunchConfig, train_on_ray
    from bertforge.training.config import TrainConfig

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = TrainConfig(data_dir=str(tmp_path / "no-data"), run_dir=str(tmp_path / "run"))
    with pytest.raises(UserInputError, match=r"--gpu asks for one GPU per worker \(2\)"):
        train_on_ray(cfg, LaunchConfig(workers=2, gpu=True))
    assert list(tmp_path.iterdir()) == []


def test_a_worker_group_that_cannot_be_scheduled_is_one_line_after_bounded_tries(monkeypatch):
    from ray.train import FailureConfig, RunConfig
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2.api.exceptions import ControllerError

    from bertforge.cluster.launch import ray_train
    from bertforge.cluster.launch.ray_train import LaunchConfig, run_on_ray

    bounded = ray_train._bounded_scheduling(RunConfig(failure_config=FailureConfig(max_failures=3)))
    assert bounded.failure_config.controller_failure_limit == ray_train.SCHEDULING_ATTEMPTS - 1
    assert bounded.failure_config.max_failures == 3

    class NeverScheduled:
        def __init__(self, *args, **kwargs):
            # On a cluster (--address): time for an autoscaler to start GPU nodes from zero.
            limit = kwargs["run_config"].failure_config.controller_failure_limit
            assert limit == ray_train.SCHEDULING_ATTEMPTS_ON_A_CLUSTER - 1
            # --cpus-per-worker holds with --gpu too (it was 1 CPU whatever the flag said).
            assert kwargs["scaling_config"].resources_per_worker == {"CPU": 6, "GPU": 1}

        def fit(self):
            raise ControllerError(controller_failure=WorkerGroupStartupTimeoutError(0))

    monkeypatch.setattr(ray_train, "_Trainer", NeverScheduled)
    with pytest.raises(UserInputError, match=r"could not start 4 workers of 1 GPU and 6 CPU "
                                             r"each in 20 tries of \d+ s: no node can hold them"
                                             r".*RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"):
        run_on_ray(print, {}, LaunchConfig(workers=4, gpu=True, address="auto",
                                           cpus_per_worker=6), RunConfig())
