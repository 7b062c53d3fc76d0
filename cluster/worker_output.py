"""What a Ray Train worker shows on the console, and where the rest goes.

Ray forwards every worker's stdout and stderr to the driver, so each worker's library chatter
reached the user's terminal: on a 2-core demo run, 221 lines of torch collectives' deprecation
warnings (`all_gather_into_tensor` and `reduce_scatter_tensor` called by DeepSpeed's ZeRO, once
per step) and DeepSpeed's start-up logs drowned the loop's own progress lines. In a worker:

- everything it writes from Python (our lines, print, logging, warnings) is kept in
  RUN_DIR/logs/worker-RANK.log, for whoever needs the full story;
- Python warnings raised outside bertforge go only there: library deprecations we cannot fix
  (our code calls no deprecated API; DeepSpeed does); a warning from our own code still shows;
- DeepSpeed's logger reaches the console from ERROR up only (its INFO/WARNING start-up lines:
  "Setting accelerator to CPU", ZeRO's settings) and the file at every level; so does Ray
  Train's worker context ("Reporting training result 1: TrainingReport(...)" per report).

The loop's own lines (`training.metrics.console`) and errors reach the console as before.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import warnings
from typing import TextIO

import bertforge.cluster
import bertforge.pipelines
import bertforge.training

LOG_DIR = "logs"
# Named by DeepSpeed (deepspeed.utils.logging); it does not propagate to the root logger.
_DEEPSPEED_LOGGER = "DeepSpeed"
# Ray Train V2's worker-side module that logs each ray.train.report at INFO; a logger's filters
# see only the records logged on it, so it is named exactly.
_RAY_TRAIN_REPORT_LOGGER = "ray.train.v2._internal.execution.context"
_OUR_DIRS = tuple(os.path.dirname(os.path.abspath(package.__file__)) + os.sep for package in
                  (bertforge.cluster, bertforge.pipelines, bertforge.training))


def worker_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, LOG_DIR, f"worker-{rank}.log")


class _Tee(io.TextIOBase):
    """Writes go to the console stream and to the log file."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.console.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.console.flush()

    def fileno(self) -> int:  # faulthandler and subprocess want the real descriptor
        return self.console.fileno()

    def isatty(self) -> bool:
        return self.console.isatty()


# The process's one log file and the warnings hook it replaced: a reused Ray worker process runs
# quiet_worker again (another run directory or rank); everything must then follow the new file.
_log: TextIO | None = None
_console_showwarning = None


def quiet_worker(run_dir: str, rank: int) -> str:
    """Set this worker process's output up as the module docstring says; returns the log's path.

    Called again in the same process, it moves everything to the new log and closes the old one.
    """
    global _log, _console_showwarning
    path = worker_log_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - the process's lifetime
    old, _log = _log, log
    if isinstance(sys.stdout, _Tee):  # a restarted worker group may reuse the process
        sys.stdout.log = log
        if isinstance(sys.stderr, _Tee):
            sys.stderr.log = log
    else:
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    if warnings.showwarning is not _to_log:  # chained once: not a warning per call so far
        _console_showwarning = warnings.showwarning
        warnings.showwarning = _to_log
    _deepspeed_errors_only_on_console(log)
    _errors_only_on_console(logging.getLogger(_RAY_TRAIN_REPORT_LOGGER), log)
    if old is not None:
        old.close()
    return path


def _to_log(message, category, filename, lineno, file=None, line=None) -> None:
    if is_ours(filename) or _log is None:
        _console_showwarning(message, category, filename, lineno, file, line)  # console and Tee
    else:
        _log.write(warnings.formatwarning(message, category, filename, lineno, line))


def is_ours(filename: str) -> bool:
    """Whether a warning was raised in bertforge's own code (which the console keeps)."""
    return os.path.abspath(filename).startswith(_OUR_DIRS)


def _deepspeed_errors_only_on_console(log: TextIO) -> None:
    # A filter on the logger itself: DeepSpeed logs its first warning while `import deepspeed`
    # runs (before any handler of its could be adjusted), and the logger object is the same
    # before and after that import.
    logger = logging.getLogger(_DEEPSPEED_LOGGER)
    _errors_only_on_console(logger, log)
    for handler in logger.handlers:  # present when deepspeed was imported before us
        if type(handler) is logging.StreamHandler:
            handler.setStream(sys.stdout)  # the Tee: its ERROR lines reach the file too


def _errors_only_on_console(logger: logging.Logger, log: TextIO) -> None:
    ours = [f for f in logger.filters if isinstance(f, _BelowErrorToLogOnly)]
    for existing in ours:  # a second call: the filter follows the new file
        existing.log = log
    if not ours:
        logger.addFilter(_BelowErrorToLogOnly(log))


class _BelowErrorToLogOnly(logging.Filter):
    """A logger's records below ERROR are written to the log file and dropped for the console;
    ERROR and up pass to its console handler (and through the Tee to the file)."""

    def __init__(self, log: TextIO) -> None:
        super().__init__()
        self.log = log
        self.formatter = logging.Formatter("[%(asctime)s] [%(levelname)s] "
                                           "[%(filename)s:%(lineno)d] %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        self.log.write(self.formatter.format(record) + "\n")
        return False
