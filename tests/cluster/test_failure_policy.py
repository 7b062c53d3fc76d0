"""In a real Ray Train run, a user error inside a worker ends the run after one attempt; any
other worker error is still retried up to max_failures."""

from __future__ import annotations

import pytest
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

from bertforge.cluster.failure_policy import UserErrorsFailAtOnce, user_errors_fail_at_once
from bertforge.cluster.ray_train import LaunchConfig, connect
from bertforge.training.errors import UserInputError


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


@pytest.mark.slow
def test_user_error_in_a_worker_ends_the_run_after_one_attempt(tmp_path):
    connect(LaunchConfig(workers=1))
    try:
        message = "shard /data/train/part-00001.arrow row 17 is corrupt: token id 65533"
        with pytest.raises(UserInputError, match="row 17 is corrupt") as caught:
            fit_failing(tmp_path, "user", UserInputError(message), max_failures=3)
        assert len((tmp_path / "user.attempts").read_text().splitlines()) == 1  # not 4
        assert str(caught.value) == message  # the command line prints this one line
    finally:
        ray.shutdown()


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

    from bertforge.cluster import ray_train
    from bertforge.cluster.ray_train import LaunchConfig, check_local_resources, connect

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    check_local_resources(LaunchConfig(workers=1, gpu=True))
    check_local_resources(LaunchConfig(workers=8, gpu=True, address="auto"))  # the cluster's
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_train.local_ray, "start", pytest.fail)  # never reached
    with pytest.raises(UserInputError, match=r"--gpu asks for one GPU per worker \(8\), and "
                                             r"this machine has 1; drop --gpu"):
        connect(LaunchConfig(workers=8, gpu=True))


def test_a_worker_group_that_cannot_be_scheduled_is_one_line_after_bounded_tries(monkeypatch):
    from ray.train import FailureConfig, RunConfig
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2.api.exceptions import ControllerError

    from bertforge.cluster import ray_train
    from bertforge.cluster.ray_train import LaunchConfig, run_on_ray

    bounded = ray_train._bounded_scheduling(RunConfig(failure_config=FailureConfig(max_failures=3)))
    assert bounded.failure_config.controller_failure_limit == ray_train.SCHEDULING_ATTEMPTS - 1
    assert bounded.failure_config.max_failures == 3

    class NeverScheduled:
        def __init__(self, *args, **kwargs):
            assert kwargs["run_config"].failure_config.controller_failure_limit >= 0

        def fit(self):
            raise ControllerError(controller_failure=WorkerGroupStartupTimeoutError(0))

    monkeypatch.setattr(ray_train, "TorchTrainer", NeverScheduled)
    with pytest.raises(UserInputError, match=r"could not start 4 workers of 1 GPU each in 5 "
                                             r"tries of \d+ s: no node can hold them"):
        run_on_ray(print, {}, LaunchConfig(workers=4, gpu=True, address="auto"), RunConfig())
