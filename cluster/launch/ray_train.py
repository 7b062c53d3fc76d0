"""Ray Train launch: a `TorchTrainer` whose workers run `training.loop.train`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import ray
import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from bertforge.cluster.launch import local_ray
from bertforge.cluster.launch.failure_policy import user_errors_fail_at_once
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.cluster.launch.parent_death import die_with_parent
from bertforge.cluster.launch.paths import absolute, refuse_output_in_the_jobs_copy
from bertforge.cluster.launch.persistence import (
    check_storage_scheme,
    storage_run_name,
    stored_checkpoints,
)
from bertforge.cluster.launch.torch_store import NodeAddressTorchConfig
from bertforge.cluster.launch.worker_output import (
    is_verbose,
    log_driver_to,
    show_train_workers,
)
from bertforge.cluster.safety.dataset_guard import reading_dataset
from bertforge.cluster.safety.run_lock import (
    exclusive_directory,
    held_with_token,
    live_holder,
    refuse_if_in_use,
)
from bertforge.training.checkpoint import (
    CHECKPOINTS_DIR,
    TRAIN_LOG,
    latest_checkpoint,
    new_run_id,
    read_metadata,
    resumes_a_checkpoint,
)
from bertforge.training.config import TrainConfig
from bertforge.training.errors import RestartsUsedUp, UserInputError
from bertforge.training.inputs import check_train_inputs, refuse_run_dir_uri
from bertforge.training.metrics import console, counted
from bertforge.training.object_storage import child_uri
from bertforge.training.resolved_engine import check_cpu_engine
from bertforge.training.resume_settings import RECORDED

# A worker group that cannot be scheduled (no node has the resources, an autoscaler that adds
# none) times out after RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (Ray's default 60 s); Ray Train
# then retries forever (FailureConfig.controller_failure_limit = -1). We allow this many tries:
# on a cluster ~20 minutes at the default, time for an autoscaler to start GPU VMs from zero
# (driver install, a multi-GB image pull: often over 5 minutes), not a run that never ends;
# locally ~5 (nothing will be added; the pre-flight already refused GPUs that are not there).
SCHEDULING_ATTEMPTS = 5
SCHEDULING_ATTEMPTS_ON_A_CLUSTER = 20


def check_local_resources(launch: LaunchConfig) -> None:
    """A local run can never get what this machine lacks: refuse it before Ray starts."""
    if launch.address or not launch.gpu:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < launch.workers:
        raise UserInputError(
            f"--gpu asks for one GPU per worker ({launch.workers}), and this machine has "
            f"{found}; drop --gpu to train on the CPU, lower --workers, or give --address of "
            "a cluster with GPU nodes")


def connect(launch: LaunchConfig) -> None:
    """Join the cluster at `address`, or start a private local Ray on the loopback address."""
    if ray.is_initialized():
        return
    check_local_resources(launch)
    if launch.address:
        _send_the_clusters_token()
        # No runtime_env here: inside a `bertforge submit` job the job's own (its working
        # directory) must reach the workers unchanged.
        ray.init(address=launch.address)
        local_ray.reclaim_signals()  # ray.init replaced our SIGTERM handler
    else:
        local_ray.start(num_cpus=max(os.cpu_count() or 1,
                                     launch.workers * launch.cpus_per_worker))
    show_train_workers()  # their lines on the console, the other Ray processes' in the log


def _send_the_clusters_token() -> None:
    """Token mode where a token is at hand and RAY_AUTH_MODE says nothing, as `ray start` and a
    local `ray.init` decide: Ray 2.60's clusters require the token, and `ray.init(address=...)`
    sends it only in token mode, so `train --address HEAD:6379` on a node of a cluster started
    by hand spent 20 s on "Authentication token is missing", then ended in a traceback."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def train_on_ray(cfg: TrainConfig, launch: LaunchConfig) -> dict[str, Any]:
    """Run training on `launch.workers` Ray workers; returns the final checkpoint's metadata.

    Ray Train V2 keeps only metrics attached to Ray checkpoints, so the outcome is read from
    the run directory, where the loop commits its checkpoints. The inputs are checked here
    first, before Ray starts (`training.inputs`); a user error inside a worker is not retried.
    """
    refuse_run_dir_uri(cfg.run_dir)  # before its lock is looked for there
    # With storage, storage holds the checkpoints a resubmitted job resumes (stable_name).
    refuse_output_in_the_jobs_copy(launch.storage, "--storage")
    if launch.storage:
        check_storage_scheme(launch.storage)
    else:
        refuse_output_in_the_jobs_copy(cfg.run_dir, "--run-dir")
    storage_name = storage_run_name(cfg.run_dir)  # against this directory, as `absolute`
    derived = cfg.derived  # what the command left to follow max_steps: read back, none is
    # Relative paths are the user's working directory's, not the workers'.
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "data_dir": absolute(cfg.data_dir),
                                 "run_dir": absolute(cfg.run_dir),
                                 "init_from": absolute(cfg.init_from)})
    launch = dataclasses.replace(launch, storage=absolute(launch.storage))
    # GPUs this machine lacks: refused before the run directory or its log is made.
    check_local_resources(launch)
    # Another run writing there: said first, as the lock below would (its checkpoints are
    # being saved and pruned, and the pre-flight would read them).
    refuse_if_in_use(cfg.run_dir)
    refuse_a_warm_start_from_a_live_run(cfg)
    if not launch.address and not launch.gpu and not resumes_a_checkpoint(cfg.run_dir,
                                                                          cfg.resume):
        check_cpu_engine(cfg.engine())  # this CPU is the workers'
    run_dir = cfg.run_dir
    storage_run = None
    if launch.storage:  # before the run directory is made: a refusal leaves none behind
        storage_run = child_uri(launch.storage, storage_name)
        if not cfg.resume:
            refuse_a_stored_run(launch.storage, storage_name, run_dir)
    check_train_inputs(cfg, launch.workers)
    warn_of_an_unfinished_source(cfg)
    # One run per run directory (and per run in storage), taken before Ray starts.
    # And a reader of its dataset, which `prepare` will not replace meanwhile.
    with exclusive_directory(run_dir, "train", storage=storage_run) as lock, \
            reading_dataset(cfg.data_dir, "train"):
        log_driver_to(os.path.join(run_dir, TRAIN_LOG))
        finished = None if launch.storage else _finished_run(cfg)
        if finished is not None:
            return finished
        try:
            connect(launch)
            return _fit(TrainConfig.from_dict({**cfg.to_dict(), "run_dir": run_dir}), launch,
                        lock.me.token, storage_name, derived)
        except SystemExit as exit_:
            stop = local_ray.as_stop(exit_)
            if stop is None:
                raise
            # Workers train on until Ray stops them: read the newest checkpoint after that, or
            # one they commit meanwhile goes unnamed (CI: the line said step 60, the resume
            # found 70). Stopping twice is harmless: driver_teardown's stop then does nothing.
            local_ray.shutdown()
            newest = latest_checkpoint(run_dir)
            stop.note = (f"newest committed checkpoint {newest}; the same command resumes "
                         "from it" if newest else "no checkpoint was committed yet")
            raise stop from None
        except WorkerGroupError as error:  # a user error's is a UserInputError by now
            raise RestartsUsedUp(restarts_used_up("run", launch, _what_a_run_left(
                launch, run_dir))) from error


def restarts_used_up(what: str, launch: LaunchConfig, left: str) -> str:
    """One line for a `what` ("run", "fine-tuning") whose workers crashed once more than
    --max-failures allows: it ended with Ray's traceback alone, which named neither the flag
    nor what `left` says (what a resubmission continues from)."""
    crashes = counted(launch.max_failures + 1, "time")
    return (f"the {what}'s workers failed {crashes}, more than --max-failures "
            f"{launch.max_failures} allows (the last failure's report is above); {left} "
            "(submitted again: with a new --submission-id)")


def _what_a_run_left(launch: LaunchConfig, run_dir: str) -> str:
    if launch.storage:
        return (f"the same command resumes from the newest checkpoint in --storage "
                f"{launch.storage}")
    newest = latest_checkpoint(run_dir)
    return (f"newest committed checkpoint {newest}; the same command resumes from it"
            if newest else "no checkpoint was committed; the same command starts it over")


def refuse_a_warm_start_from_a_live_run(cfg: TrainConfig) -> None:
    """A new run whose --init-from names a run directory that a train is still writing: its
    newest checkpoint is only where that run has got to (phase 2 took step 240 of a phase 1
    of 400, and said so only in passing). A checkpoint named by its own path is taken as
    asked."""
    source = _warm_start_run_dir(cfg)
    if source is None:
        return
    holder = live_holder(source)
    if holder is None:
        return
    newest = latest_checkpoint(source)
    at = f"its newest checkpoint, {newest}, is only where it has got to" if newest else \
        "it has no checkpoint yet"
    raise UserInputError(
        f"--init-from {source} is a run still training (bertforge {holder.command}: "
        f"{holder.describe()}): {at}; wait for it to end, or name the checkpoint to start "
        f"from ({os.path.join(source, CHECKPOINTS_DIR, 'step_NNNNNNNN')})")


def warn_of_an_unfinished_source(cfg: TrainConfig) -> None:
    """A new run warm-started from a run directory whose newest checkpoint is short of the
    steps that run was to train (stopped, crashed, or killed past its restarts, and never
    resumed): phase 2 from a phase 1 cut at step 240 of 400 looked like any other warm start.
    Said, not refused: an early phase 1 may be what is wanted."""
    source = _warm_start_run_dir(cfg)
    newest = latest_checkpoint(source) if source else None
    if newest is None:
        return
    metadata = read_metadata(newest)
    step, planned = metadata.get("global_step"), (metadata.get(RECORDED) or {}).get("max_steps")
    if isinstance(step, int) and isinstance(planned, int) and step < planned:
        console(f"[train] warning: --init-from {source} is a run that stopped at step {step} of "
                f"its {planned}: this run starts from {newest}; resume that run first (the "
                "same command it was started with) to start from its end")


def _warm_start_run_dir(cfg: TrainConfig) -> str | None:
    """--init-from where it names a training run's directory and this run warm-starts from it
    (a run that resumes its own checkpoint reads no --init-from); None for a checkpoint or a
    Hugging Face directory named by its path, or nothing: the pre-flight's to say."""
    source = cfg.init_from
    if not source or resumes_a_checkpoint(cfg.run_dir, cfg.resume):
        return None
    return source if os.path.isdir(os.path.join(source, CHECKPOINTS_DIR)) else None


def refuse_a_stored_run(storage: str, name: str, run_dir: str) -> None:
    """--resume never with storage that already holds this run directory's run: Ray Train
    would take the new run's checkpoints for that run's and prune the older ones, which a new
    run must never delete (locally they are moved aside to RUN_DIR/previous/)."""
    stored = stored_checkpoints(storage, name)
    if stored:
        raise UserInputError(
            f"--resume never: {storage} holds an earlier run of {run_dir} ({len(stored)} "
            f"checkpoint(s), newest {stored[-1]}); continue it (--resume auto), or start the "
            "new run in another --run-dir or --storage")


def _finished_run(cfg: TrainConfig) -> dict[str, Any] | None:
    """`--resume auto` of a run whose newest checkpoint is at --steps (or past them): what the
    run ended with, without starting Ray and its workers only for them to load the checkpoint
    and stop (20-30 s on 2 cores). None: there is training to do."""
    newest = latest_checkpoint(cfg.run_dir) if cfg.resume else None
    if newest is None:
        return None
    metadata = read_metadata(newest)
    if metadata["global_step"] < cfg.max_steps:
        return None
    console(f"[train] {cfg.run_dir} is at step {metadata['global_step']} of {cfg.max_steps}: "
            f"nothing to train (raise --steps to train on); weights in {newest}")
    return {"step": metadata["global_step"], "checkpoint_path": newest,
            "run_id": metadata.get("run_id")}


def _fit(cfg: TrainConfig, launch: LaunchConfig, lock_token: str, storage_name: str,
         derived: tuple[str, ...] = ()) -> dict[str, Any]:
    run_dir = cfg.run_dir
    # A new run's id, chosen once for the launch: a worker group Ray restarts after a failure
    # continues this run's checkpoints instead of starting it over (training.loop.train).
    run_id = None if cfg.resume else new_run_id()
    result = run_on_ray(
        _worker_main,
        {"train": cfg.to_dict(), "threads": launch.cpus_per_worker,
         "persist": bool(launch.storage), "run_id": run_id, "lock_token": lock_token,
         "local_ray": not launch.address, "derived": list(derived)},
        launch, _run_config(cfg, launch, storage_name),
    )
    if launch.storage:
        # The driver's node need not hold the files: the outcome is what storage registered,
        # and the run its worker reported (the summary lacked run_id with --storage alone).
        return {"step": result.metrics["step"], "checkpoint_path": result.checkpoint.path,
                "run_id": result.metrics.get("run_id")}
    final = latest_checkpoint(run_dir)
    if final is None:
        raise RuntimeError(f"training finished without a complete checkpoint in {run_dir}")
    metadata = read_metadata(final)
    # The run whose weights these are (a fresh start moved an older run's aside: previous/).
    return {"step": metadata["global_step"], "checkpoint_path": final,
            "run_id": metadata.get("run_id")}


def run_on_ray(
    worker_fn: Callable[[dict[str, Any]], None], worker_config: dict[str, Any],
    launch: LaunchConfig, run_config: RunConfig,
) -> ray.train.Result:
    """`worker_fn(worker_config)` on `launch.workers` Ray Train workers joined in a torch process
    group (NCCL with --gpu, else gloo): pretraining's launch, and fine-tuning's. Ray must be
    connected (`connect`); a user error in a worker is not retried. `worker_config["verbose"]`
    says whether the workers show everything (`worker_output.quiet_worker`)."""
    trainer = _Trainer(
        worker_fn,
        train_loop_config={**worker_config, "verbose": is_verbose()},
        torch_config=NodeAddressTorchConfig(backend="nccl" if launch.gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=launch.workers,
            use_gpu=launch.gpu,
            # With --gpu too: the CPUs a worker's loader threads and torch ops use are its own.
            resources_per_worker={"CPU": launch.cpus_per_worker,
                                  **({"GPU": 1} if launch.gpu else {})},
            placement_strategy=launch.placement_strategy,
        ),
        run_config=_bounded_scheduling(run_config, _scheduling_attempts(launch)),
    )
    with user_errors_fail_at_once():
        try:
            return trainer.fit()
        except SystemExit:  # a stop (SIGTERM, Ctrl-C): see _Trainer
            if launch.address:
                trainer.abort()
            raise
        except ControllerError as error:
            if isinstance(error.controller_failure, WorkerGroupStartupTimeoutError):
                raise UserInputError(_unschedulable(launch)) from None
            raise


class _Trainer(TorchTrainer):
    """Ray Train's TorchTrainer, leaving the driver's SIGINT handler in place.

    `fit()` replaces it with Ray Train's own (abort the controller, then sys.exit(0) from
    inside `ray.get`), after which Ctrl-C ended `train`, `pipeline` and `finetune --workers N`
    with exit code 1 and not a line said. The driver's handler (`local_ray.driver_teardown`)
    stops them as it stops them for SIGTERM: Ray shut down, the lock released, one line, 130.
    On a cluster (--address) shutting Ray down only disconnects the driver, and its workers
    would die after the lock is gone: a stop first aborts the run (`abort`), as Ray's handler
    did, and waits for it.
    """

    controller = None

    def _register_sigint_handler(self, controller) -> None:  # DataParallelTrainer's hook
        self.controller = controller

    def abort(self, timeout_s: float = 120.0) -> None:
        """The run's workers stopped before the driver goes on (a stop's clean-up)."""
        if self.controller is not None:
            with contextlib.suppress(Exception):  # a controller already gone: nothing to stop
                ray.get(self.controller.abort.remote(), timeout=timeout_s)


def _scheduling_attempts(launch: LaunchConfig) -> int:
    return SCHEDULING_ATTEMPTS_ON_A_CLUSTER if launch.address else SCHEDULING_ATTEMPTS


def _bounded_scheduling(run_config: RunConfig, attempts: int = SCHEDULING_ATTEMPTS
                        ) -> RunConfig:
    failure = run_config.failure_config or FailureConfig()
    failure = dataclasses.replace(failure, controller_failure_limit=attempts - 1)
    return dataclasses.replace(run_config, failure_config=failure)


def _unschedulable(launch: LaunchConfig) -> str:
    per_worker = f"{'1 GPU and ' if launch.gpu else ''}{launch.cpus_per_worker} CPU"
    timeout = float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", 60))
    return (f"the cluster could not start {counted(launch.workers, 'worker')} of {per_worker} "
            f"each in {_scheduling_attempts(launch)} tries of {timeout:.0f} s: no node can hold "
            "them, or the autoscaler added none; check --workers, --gpu and --cpus-per-worker "
            "against the cluster's nodes (`ray status`), or give nodes that start slowly "
            "longer (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, seconds a try)")


def _run_config(cfg: TrainConfig, launch: LaunchConfig, storage_name: str) -> RunConfig:
    failure = FailureConfig(max_failures=launch.max_failures)
    if launch.storage:
        # Re-running with the same run name and storage resumes from storage's newest.
        return RunConfig(
            name=storage_name, storage_path=launch.storage,
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
            failure_config=failure, logging_config=QUIET_RAY_TRAIN,
        )
    # Ray Train's own state lives in RUN_DIR/ray, beside our checkpoints.
    return RunConfig(name="ray", storage_path=cfg.run_dir, failure_config=failure,
                     logging_config=QUIET_RAY_TRAIN)


# Ray Train's INFO lines (resources requested, worker group started, process group set up) stay
# in Ray's session logs; the console gets its warnings and errors.
QUIET_RAY_TRAIN = ray.train.LoggingConfig(log_level="WARNING")


def _worker_main(loop_config: dict[str, Any]) -> None:
    """Entry point on every Ray worker: the process group is already set up by Ray Train."""
    import torch

    from bertforge.cluster.launch.persistence import report_checkpoint, restore_latest
    from bertforge.cluster.launch.worker_output import quiet_worker

    if loop_config.get("local_ray"):
        # Its raylet dies with the driver (Ray's fate sharing); the worker, a process group of
        # its own, went on training after `kill -9` of the driver's group, committing
        # checkpoints into a run directory that was no longer locked. Not on a cluster: a
        # driver gone there is Ray's to handle (the raylet is the node's, not this run's).
        die_with_parent()
    torch.set_num_threads(loop_config["threads"])
    cfg = TrainConfig.from_dict(loop_config["train"])
    # Library output to RUN_DIR/logs/worker-RANK.log only; our progress lines to the console.
    # Before the loop is imported: importing DeepSpeed logs its first warning.
    quiet_worker(cfg.run_dir, ray.train.get_context().get_world_rank(),
                 verbose=loop_config.get("verbose", False))
    from bertforge.training.loop import train
    if not loop_config["persist"]:
        _refuse_a_run_dir_of_its_own(cfg.run_dir, loop_config["lock_token"])
    run_id = loop_config.get("run_id")
    derived = tuple(loop_config.get("derived", ()))  # lost in the config's dict
    if loop_config["persist"]:
        # A new run's storage holds only its own checkpoints (refuse_a_stored_run).
        if cfg.resume or run_id is not None:
            restore_latest(cfg.run_dir)
        train(cfg, report=report_checkpoint, run_id=run_id, derived=derived)
    else:
        train(cfg, report=lambda metrics: ray.train.report({"step": metrics["step"]}),
              run_id=run_id, derived=derived)


def _refuse_a_run_dir_of_its_own(run_dir: str, lock_token: str) -> None:
    """Without --storage every rank writes its part of each checkpoint into the one run
    directory: a worker that does not see the driver's lock there has a directory of its own
    (a node-local path, a relative --run-dir inside a job's per-node working directory), and
    the run would end, after all its steps, with no complete checkpoint anywhere."""
    import socket

    if not held_with_token(run_dir, lock_token):
        raise UserInputError(
            f"--run-dir {run_dir} on node {socket.gethostname()} is not the directory the "
            "driver locked: without --storage the run directory must be on a filesystem every "
            "node mounts (infra/'s clusters mount one at /shared), or add --storage")
