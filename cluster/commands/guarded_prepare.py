"""`bertforge prepare`: the Beam job (`pipelines.prepare`) inside the dataset guard
(`cluster.safety.dataset_guard`): one writer per dataset, no other dataset replaced unasked
(`--overwrite`), none under a run that reads it, nothing half-made left by a failure; a stop
ends Beam's worker processes at once and keeps the work the same command continues."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from bertforge.cluster.launch import local_ray
from bertforge.cluster.safety.dataset_guard import OVERWRITE_FLAG, is_local, writing_dataset
from bertforge.pipelines.local.work_dir import WORK_DIR_NAME
from bertforge.pipelines.prepare import dataset_summary, run_command
from bertforge.pipelines.prepare_options import PrepareCommand

OVERWRITE_HELP = (
    f"{OVERWRITE_FLAG} replaces a dataset already in the output directory that other inputs, "
    "vocabulary or instance parameters made (without it such a run is refused, naming what "
    "differs; the same job again over a finished dataset has nothing to do and says so, and "
    "over a stopped one continues it). A dataset that a running train or eval "
    "reads is never replaced.\n"
    "A local run records its work in OUTPUT/.prepare-work as it goes: after a kill (kill -9, "
    f"Ctrl-C, a reboot) the same command continues it; {OVERWRITE_FLAG} starts over instead.\n"
    "--verbose shows Beam's own lines on the console too; without it they go to the job's log "
    "only (OUTPUT/logs/prepare.log).\n")


def prepare_guarded(command: PrepareCommand, *, overwrite: bool) -> dict[str, Any]:
    """Run the parsed command inside the guard; returns the job's summary."""
    output = command.config.output
    if command.dry_run:
        return run_command(command)  # nothing is written
    if is_local(output) and os.path.isfile(output):  # else the lock's "File exists" first
        raise ValueError(f"--output {output} is a file; give a directory for the dataset")
    with stoppable_beam_job(output), \
            writing_dataset(output, command.config, overwrite=overwrite):
        # Past the guard, a dataset there is this job's (or --overwrite was given).
        if not overwrite and is_local(output) and dataset_complete(output):
            if not command.quiet:  # --quiet: the summary only
                # On stderr, with the job's other lines: stdout is the summary's JSON alone.
                # Inputs compare by location, size and the format each is read as, not by
                # content (a corpus of terabytes).
                print(f"[prepare] {output} already holds this dataset (the same settings, and "
                      "inputs of the same names and sizes, read as the same formats): nothing "
                      "to do (--overwrite makes it again)", file=sys.stderr, flush=True)
            return {**dataset_summary(output, 0.0), "unchanged": True}
        return run_command(command, start_over=overwrite)


def dataset_complete(output: str) -> bool:
    """A finished dataset (`manifest.finished_dataset`): the same job again then has nothing to
    do; it used to delete the manifest first and redo the whole job (hours on a large corpus),
    and a kill meanwhile lost the dataset. What a run killed after its manifest left beside it
    (its work record, temporary pieces) is removed first, without a word: it is no part of
    the dataset (`local_job.drop_a_finished_runs_leftovers`)."""
    from bertforge.pipelines.contract.manifest import finished_dataset
    from bertforge.pipelines.local_job import drop_a_finished_runs_leftovers

    drop_a_finished_runs_leftovers(output)
    return finished_dataset(output.removeprefix("file://"))


@contextlib.contextmanager
def stoppable_beam_job(output: str) -> Iterator[None]:
    """Around a local Beam job into `output` (`prepare`, the pipeline's prepare stages): a stop
    ends its worker processes at once (`stop_beam_workers`), and its line says that the same
    command continues the work kept."""
    try:
        with local_ray.on_stop(stop_beam_workers):
            yield
    except SystemExit as exit_:
        stop = local_ray.as_stop(exit_)
        work = os.path.join(output, WORK_DIR_NAME)
        if stop is None or not is_local(output) or not os.path.isdir(work):
            raise
        stop.note = f"the same command continues it (its work is in {work})"
        raise stop from exit_


def stop_beam_workers() -> None:
    """Terminate this process's Beam SDK worker processes (`multi_processing`), so that the
    runner's cleanup, which joins them, ends at once on SIGTERM or Ctrl-C."""
    import psutil

    from bertforge.pipelines.local.quiet_harness import WORKER_MODULES

    workers = [p for p in psutil.Process().children(recursive=True)
               if any(module in " ".join(_cmdline(p)) for module in WORKER_MODULES)]
    # Beam's threads watching them then fail ("Worker subprocess exited with return code
    # -15", and, on a loaded machine, its control channel's reader): expected now, so not a
    # traceback on the console.
    default_hook = threading.excepthook
    threading.excepthook = lambda args: None if _beams_thread(args) else default_hook(args)
    for worker in workers:
        with contextlib.suppress(psutil.Error):
            worker.terminate()


def _beams_thread(args) -> bool:
    """A thread of Beam's runner failed: one that watched a worker (`run_worker`), or one with
    Beam's code in its traceback (the worker's control channel reader, `_control_read`)."""
    if args.thread is None:
        return False
    if args.thread.name == "run_worker":
        return True
    frame = args.exc_traceback
    while frame is not None:
        if f"{os.sep}apache_beam{os.sep}" in frame.tb_frame.f_code.co_filename:
            return True
        frame = frame.tb_next
    return False


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []
