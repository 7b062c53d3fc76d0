"""A user error inside a worker ends the run after one attempt; any other worker error is still
retried up to max_failures (the policy's decisions; a real Ray Train run of a user error is in
test_fault_tolerance, on that module's local Ray)."""

from __future__ import annotations

import os

import pytest
from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2.api.exceptions import WorkerGroupError

from bertforge.cluster.launch.failure_policy import UserErrorsFailAtOnce
from bertforge.training.errors import UserInputError


def test_other_worker_errors_are_still_retried(capsys, monkeypatch):
    """Ray's own decisions for everything else (a real run of that costs a minute here), each
    restart said on the console: a worker's traceback, then steps again from an earlier one,
    read as if the run had crashed, and nothing said that a restart was used up."""
    from bertforge.cluster.launch import worker_output

    policy = UserErrorsFailAtOnce(FailureConfig(max_failures=1))
    crash = WorkerGroupError("rank 0 died", {0: RuntimeError("worker crashed")})
    assert policy.make_decision(crash) == FailureDecision.RETRY
    notice = capsys.readouterr().out  # written by Ray Train's controller, in its process
    assert notice == ("[bertforge] a worker failed (failure 1, --max-failures 1): restarting "
                      "the workers, from the newest checkpoint where there is one\n")
    assert policy.make_decision(crash) == FailureDecision.RAISE  # max_failures used up
    assert capsys.readouterr().out == ""  # the command's own last line says it (ray_train)
    # The driver shows the notice as its command's line, and none of the controller's others.
    monkeypatch.setattr(worker_output, "_driver_command", "train")
    worker_output._print_train_worker_lines({
        "actor_name": "TrainController", "pid": 7, "is_err": False,
        "lines": ["[2026-11-29 16:33:40,385 E 12567 12602] core_worker.cc:2465: Actor ...",
                  notice.rstrip("\n")]})
    assert capsys.readouterr().out == ("[train] a worker failed (failure 1, --max-failures 1): "
                                       "restarting the workers, from the newest checkpoint "
                                       "where there is one\n")
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


def crashes_past_its_restarts(*args, **kwargs):
    """What Ray Train's fit raises once the worker group failed past max_failures."""
    raise WorkerGroupError("Training failed due to worker errors:\n[Rank 0 Error Snippet]:"
                           "\nA worker health check failed.",
                           {0: RuntimeError("A worker health check failed.")})


def test_a_run_whose_restarts_are_used_up_ends_with_what_it_left(tmp_path, monkeypatch, capsys):
    """A worker that kept dying (a node lost twice with --max-failures 1) ended `train` with
    Ray's traceback of some 45 lines alone: no word of the flag, nor of the checkpoint that
    the same command resumes from. Ray's report stays; one line of ours follows it."""
    from bertforge.cluster.cli import main
    from bertforge.cluster.launch import ray_train
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "shards"), {"train": [32], "validation": [8]})
    run_dir = tmp_path / "run"
    newest = str(run_dir / "checkpoints" / "step_00000400")

    monkeypatch.setattr(ray_train, "connect", lambda launch: None)
    monkeypatch.setattr(ray_train, "_fit", crashes_past_its_restarts)
    argv = ["train", "--address", "auto", "--data", data, "--run-dir", str(run_dir),
            "--workers", "2", "--max-failures", "1", "--steps", "10", "--batch-size", "8",
            "--resume", "never"]
    for committed, left in ((None, "no checkpoint was committed; the same command starts it "
                                   "over"),
                            (newest, f"newest committed checkpoint {newest}; the same command "
                                     "resumes from it")):
        monkeypatch.setattr(ray_train, "latest_checkpoint",
                            lambda run_dir, found=committed: found)
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert "ray.train.WorkerGroupError: Training failed due to worker errors:" in err
        assert "A worker health check failed." in err
        assert err[-1] == ("bertforge train: error: the run's workers failed 2 times, more than "
                           "--max-failures 1 allows (the last failure's report is above); "
                           f"{left} (submitted again: with a new --submission-id)")


def test_a_fine_tuning_whose_restarts_are_used_up_ends_with_what_it_left(tmp_path, monkeypatch,
                                                                        capsys):
    """The same for `finetune` on Ray Train workers: Ray's report, then one line naming the
    flag and that the same command reruns only what did not finish."""
    from bertforge.cluster.cli import main
    from bertforge.cluster.commands import finetune_sweep
    from tests.support.finetune_data import tiny_bert_dir, write_sst2_tsv

    monkeypatch.setattr(finetune_sweep, "connect", lambda launch: None)
    monkeypatch.setattr(finetune_sweep, "run_on_ray", crashes_past_its_restarts)
    argv = ["finetune", "--task", "sst2", "--model", tiny_bert_dir(str(tmp_path / "model")),
            "--train", write_sst2_tsv(str(tmp_path / "sst2" / "train.tsv"), 16, 0),
            "--dev", write_sst2_tsv(str(tmp_path / "sst2" / "dev.tsv"), 8, 1),
            "--output", str(tmp_path / "ft"), "--address", "auto", "--workers", "2",
            "--max-failures", "2", "--max-steps", "2", "--batch-size", "8"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "ray.train.WorkerGroupError: Training failed due to worker errors:" in err
    assert err[-1] == ("bertforge finetune: error: the fine-tuning's workers failed 3 times, "
                       "more than --max-failures 2 allows (the last failure's report is "
                       "above); the same command runs again what did not finish (each "
                       "finished run is reused) (submitted again: with a new --submission-id)")


def test_joining_a_cluster_sends_its_token_as_ray_start_does(monkeypatch):
    """`train --address HEAD:6379` on a node of a cluster started by hand (`ray start`), with
    the cluster's token at hand and RAY_AUTH_MODE unset: Ray's client sent no token, spent
    20 s on "Authentication token is missing" and ended in a traceback."""
    import ray
    from ray._raylet import (
        AuthenticationMode,
        AuthenticationTokenLoader,
        Config,
        get_authentication_mode,
    )

    from bertforge.cluster.launch import ray_train
    from bertforge.cluster.launch.ray_train import LaunchConfig, connect

    modes = []
    mode_before = os.environ.pop("RAY_AUTH_MODE", None)  # connect sets it: restored below
    try:
        with monkeypatch.context() as patched:
            patched.setenv("RAY_AUTH_TOKEN", "0123456789abcdef0123456789abcdef")
            Config.initialize("")  # as a process that imported Ray without token mode
            AuthenticationTokenLoader.instance().reset_cache()  # the token given here
            patched.setattr(ray, "is_initialized", lambda: False)
            patched.setattr(ray, "init", lambda **kwargs: modes.append(get_authentication_mode()))
            patched.setattr(ray_train.local_ray, "reclaim_signals", lambda: None)
            patched.setattr(ray_train, "show_train_workers", lambda: None)
            connect(LaunchConfig(workers=1, address="127.0.0.2:6379"))
    finally:
        # This process's own mode and token again, for the tests after this one.
        os.environ.pop("RAY_AUTH_MODE", None)
        if mode_before is not None:
            os.environ["RAY_AUTH_MODE"] = mode_before
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    assert modes == [AuthenticationMode.TOKEN]
