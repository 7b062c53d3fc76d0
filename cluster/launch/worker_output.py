"""What the console shows, in the `bertforge` driver and in each Ray Train worker, and where the
rest goes.

The engines write a lot: Ray's token-authentication notice and its actors' C++ warnings, Ray
Train's "Reporting training result" per rank, DeepSpeed's start-up logs, its memory reports
(`see_memory_usage`: "MA ... CPU Virtual Memory") and checkpoint-reading prints ("Processing zero
checkpoint ..."), transformers' progress bars, torch's deprecation warnings once per step. The
console keeps the project's own lines (stages, progress, step lines, warnings that ask the user
to act, summaries) and errors; everything else goes to a log file only:

- a process's stdout and stderr become a `_Console`: every write goes to the log file, and to the
  console when bertforge's own code wrote it (a frame of cluster/, pipelines/ or training/ made
  the call), when a log record made it that is bertforge's or an ERROR, or when Python itself did
  (an uncaught exception's traceback). A third-party library's print, progress bar or log line
  (any logger: Ray's, DeepSpeed's, transformers', Beam's) stays in the file;
- Python warnings raised outside bertforge go only to the file; one of our own still shows;
- logging handlers that already held the real stdout or stderr are pointed at the `_Console`;
- the driver shows a Ray Train worker's lines (which passed the worker's own `_Console`) without
  Ray's "(RayTrainWorker pid=...)" prefix; every other Ray process's forwarded output (the
  controller's) goes to the file.

`--verbose` shows everything on the console as well (the file still gets it all). Files:
RUN_DIR/logs/worker-RANK.log per worker; the driver's RUN_DIR/logs/COMMAND.log (`bertforge
train`), OUTPUT/logs/COMMAND.log (`finetune`, `glue`, `demo`), RUN_DIR/logs/eval.log and
export.log for the checkpoint's run, and `prepare`'s beside its output (a local one) or in the
temporary directory. The driver keeps what is written before it knows its directory in memory
and writes it out once the command has claimed the directory (`log_driver_to`).
"""

from __future__ import annotations

import atexit
import importlib
import io
import logging
import os
import re
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from typing import TextIO

import bertforge.cluster
import bertforge.pipelines
import bertforge.training
from bertforge.pipelines.contract.config_fields import option
from bertforge.pipelines.log_only import LOG_ONLY_ATTRIBUTE

LOG_DIR = "logs"
_OUR_DIRS = tuple(os.path.dirname(os.path.abspath(package.__file__)) + os.sep for package in
                  (bertforge.cluster, bertforge.pipelines, bertforge.training))
# Python's own modules (traceback, an uncaught exception's report) reach the console; logging's
# writes are judged by their record. Third-party packages live under site-/dist-packages.
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep
                      for key in ("stdlib", "platstdlib")})
_LOGGING_FILE = os.path.abspath(logging.__file__)
# Ray replaces builtins.print with stand-ins: Ray Train V2 in its processes (which also logs the
# text at INFO on the root logger: a print written twice), Ray's tqdm support in the driver once
# it forwarded a worker's lines. A write from one is judged by print's caller; the patches are
# also turned off where the environment reaches (the driver and a local Ray's workers).
_PRINT_STAND_INS = ("redirected_print", "safe_print")
_PRINT_PATCHES_OFF = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_TQDM_PATCH_PRINT": "0"}
# Ray prefixes a forwarded line of a Ray Train worker with this actor name.
_TRAIN_WORKER_ACTOR = "RayTrainWorker"
# Ray Train's controller: of its forwarded lines the driver shows only those that begin with
# CONTROLLER_NOTICE (`failure_policy`'s restart notices), as its own command's.
_CONTROLLER_ACTOR = "TrainController"
CONTROLLER_NOTICE = "[bertforge] "


def worker_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, LOG_DIR, f"worker-{rank}.log")


def is_ours(filename: str) -> bool:
    """Whether a file is bertforge's own code (whose output and warnings the console keeps)."""
    return os.path.abspath(filename).startswith(_OUR_DIRS)


def _is_python_itself(filename: str) -> bool:
    path = os.path.abspath(filename)
    return (filename.startswith("<") or path.startswith(_STDLIB_DIRS)) and \
        "-packages" + os.sep not in path


def record_is_ours(record: logging.LogRecord) -> bool:
    """A log record for the console: bertforge's (by logger, or a print Ray Train turned into a
    record at the caller's line), or an error from anyone but Beam (whose errors reach us)."""
    if getattr(record, LOG_ONLY_ATTRIBUTE, False):
        return False  # a line per input file or shard (pipelines.log_only)
    package = record.name.split(".")[0]
    # Beam logs a failing DoFn's error with its traceback, then raises it to the pipeline's
    # run(), where the command reports it in one line: its copy belongs in the log only. So
    # does Ray Train's "Error in training function" traceback of a worker's user error, which
    # is not retried and which the driver reports in one line.
    return ((record.levelno >= logging.ERROR and package != "apache_beam"
             and not _ray_train_copy_of_a_user_error(record))
            or package == "bertforge" or is_ours(record.pathname))


# A traceback's last line: "package.module.ClassName: message".
_RAISED = re.compile(r"^(bertforge(?:\.\w+)+)\.(\w+): ")


def _ray_train_copy_of_a_user_error(record: logging.LogRecord) -> bool:
    """Ray Train's traceback of an exception that ended a worker, when that exception (the
    traceback's last line: not one it was raised while handling) is a UserInputError."""
    if not record.name.startswith("ray.train"):
        return False
    message = record.getMessage()
    if not message.startswith("Error in training function"):
        return False
    lines = message.strip().splitlines()
    raised = _RAISED.match(lines[-1]) if lines else None
    if raised is None:
        return False
    from bertforge.training.errors import UserInputError

    try:
        error_class = getattr(importlib.import_module(raised.group(1)), raised.group(2))
    except (ImportError, AttributeError):
        return False
    return isinstance(error_class, type) and issubclass(error_class, UserInputError)


def written_by_us(frame) -> bool:
    """Whether the write made by `frame` belongs on the console (see the module docstring)."""
    while frame is not None and frame.f_code.co_name in _PRINT_STAND_INS:
        frame = frame.f_back  # Ray's print() stand-ins: judge print's caller
    if frame is None:
        return True  # no Python caller: the interpreter itself
    filename = frame.f_code.co_filename
    if os.path.abspath(filename) == _LOGGING_FILE:
        record = frame.f_locals.get("record")
        return record_is_ours(record) if isinstance(record, logging.LogRecord) else True
    return is_ours(filename) or _is_python_itself(filename)


def _caller():
    """The frame that called `_Console.write`, or None where no Python frame did: the
    interpreter printing an uncaught exception once the stack has unwound. (`sys._getframe(1)`
    raises there, and the interpreter then dropped the rest of the traceback: a crash of any
    quiet command ended with exit code 1, nothing on the console and at most the report's first
    piece in its log.)"""
    try:
        return sys._getframe(2)
    except ValueError:
        return None


class _Console(io.TextIOBase):
    """A stdout or stderr: every write to the log, ours (or all, verbose) to the console too."""

    def __init__(self, console: TextIO, log: TextIO, verbose: bool) -> None:
        self.console, self.log, self.verbose = console, log, verbose

    def write(self, text: str) -> int:
        global _held_back
        self.log.write(text)
        if self.verbose or written_by_us(_caller()):
            self.console.write(text)
        elif text.strip():
            _held_back = True
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.console.flush()

    def fileno(self) -> int:  # faulthandler and subprocess want the real descriptor
        return self.console.fileno()

    def isatty(self) -> bool:
        return self.console.isatty()

    @property
    def closed(self) -> bool:
        """The console's state: an atexit hook (Ray's colorama) asks this before `isatty`, and
        a console closed under us (pytest's capture) must not raise there."""
        return bool(getattr(self.console, "closed", False))

    @property
    def encoding(self) -> str:
        return getattr(self.console, "encoding", "utf-8")


class _MemoryLog(io.StringIO):
    """The driver's log until it knows its file (`log_driver_to`)."""


# The process's one log file and the warnings hook it replaced: a reused Ray worker process runs
# quiet_worker again (another run directory or rank); everything must then follow the new file.
_log: TextIO | None = None
_console_showwarning = None
_verbose = False


def _route(log: TextIO, verbose: bool) -> TextIO | None:
    """stdout, stderr, warnings and existing console handlers through `log`; returns the log
    this replaced (None the first time)."""
    global _log, _console_showwarning, _verbose
    old, _log, _verbose = _log, log, verbose
    if isinstance(sys.stdout, _Console):  # a restarted worker group may reuse the process
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, _Console):
                stream.log, stream.verbose = log, verbose
    else:
        real = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        sys.stdout = _Console(sys.stdout, log, verbose)
        sys.stderr = _Console(sys.stderr, log, verbose)
        _repoint_console_handlers(real)
    if warnings.showwarning is not _to_log:  # chained once: not a warning per call so far
        _console_showwarning = warnings.showwarning
        warnings.showwarning = _to_log
    return old


def _repoint_console_handlers(real: tuple) -> None:
    """Handlers made before us hold the real stream: they write through the `_Console` now."""
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict
                                       .values() if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream in real:
                handler.setStream(sys.stderr if handler.stream in real[1::2] else sys.stdout)


def _to_log(message, category, filename, lineno, file=None, line=None) -> None:
    if is_ours(filename) or _log is None or _verbose:
        _console_showwarning(message, category, filename, lineno, file, line)  # console and log
    else:
        _log.write(warnings.formatwarning(message, category, filename, lineno, line))


def quiet_worker(run_dir: str, rank: int, verbose: bool = False) -> str:
    """Set this worker process's output up as the module docstring says; returns the log's path.

    Called again in the same process, it moves everything to the new log and closes the old one.
    """
    path = worker_log_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - the process's lifetime
    old = _route(log, verbose)
    if old is not None:
        old.close()
    return path


# --- the driver (`bertforge COMMAND`) --------------------------------------------------------


@dataclass
class ConsoleConfig:
    """What the console shows; one `--verbose` flag for every command that runs an engine."""

    verbose: bool = option(False, "also show the engines' own output (Ray, DeepSpeed, "
                           "transformers, Beam) on the console; it always goes to the "
                           "command's log file")


_driver_command: str | None = None
_held_back = False  # whether the log holds lines the console did not show
_refused = False  # the command ended with a line of its own (`ended_with_its_own_line`)


def quiet_driver(command: str, verbose: bool = False) -> None:
    """Route this `bertforge COMMAND` process's output (module docstring); the log is kept in
    memory until `log_driver_to` names its file, or written to the temporary directory at exit."""
    global _driver_command, _refused
    _driver_command = command
    _refused = False
    for name, value in _PRINT_PATCHES_OFF.items():
        os.environ.setdefault(name, value)
    _route(_MemoryLog(), verbose)
    atexit.unregister(_flush_unclaimed_log)  # once, however often main() runs in a process
    atexit.register(_flush_unclaimed_log)


def log_driver_to(path: str) -> str | None:
    """The driver's log goes to `path` from now on (with what was kept so far); the first call
    wins (the demo's directory, not its training stage's). None: not a quiet driver."""
    if not isinstance(_log, _MemoryLog):
        return driver_log_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - the process's lifetime
    log.write(_log.getvalue())
    _route(log, _verbose)
    return path


def driver_log_path() -> str | None:
    return getattr(_log, "name", None) if _driver_command else None


def is_verbose() -> bool:
    """Whether this process shows everything (`--verbose`); Ray workers are told so."""
    return _verbose


def ended_with_its_own_line() -> None:
    """The command ends with one line of its own: a user error's (exit code 2) or a stop's."""
    global _refused
    _refused = True


def _flush_unclaimed_log() -> None:
    """A command that never claimed a directory (it failed first, or its output is gs://...):
    its log goes to the temporary directory, named on the console. Not for a log that holds
    nothing the console did not show and no traceback (a `prepare --dry_run=True`, which makes
    no OUTPUT: a copy of its report, named nowhere, was left in TMPDIR at every dry run), nor
    for a refusal or a stop whose log holds only the engines' import chatter (DeepSpeed's
    "Setting accelerator to CPU"): its one line says it all, and every mistyped flag or Ctrl-C
    left a file in /tmp; one after an engine's traceback (a Beam job that failed) keeps it."""
    if not isinstance(_log, _MemoryLog) or not _log.getvalue():
        return
    traceback_kept = "Traceback (most recent call last)" in _log.getvalue()
    if (_refused or not _held_back) and not traceback_kept:
        return
    path = log_driver_to(os.path.join(tempfile.gettempdir(),
                                      f"bertforge-{_driver_command}-{os.getpid()}.log"))
    if _held_back:  # a refusal's one line is all there is: no second line for it
        console = sys.stderr.console if isinstance(sys.stderr, _Console) else sys.stderr
        console.write(f"bertforge {_driver_command}: the engines' output is in {path}\n")


def show_train_workers() -> None:
    """After `ray.init`: a Ray Train worker's forwarded lines reach the console without Ray's
    prefix; Ray's own printing of every forwarded line (its `print_to_stdstream`) then writes
    to the log only, being a library's write. Nothing to do when verbose or not a quiet driver."""
    if _driver_command is None or _verbose:
        return
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    dispatcher.remove_handler(_DISPATCH_NAME)
    dispatcher.add_handler(_DISPATCH_NAME, _print_train_worker_lines)


_DISPATCH_NAME = "bertforge_train_workers"


def _print_train_worker_lines(data: dict) -> None:
    actor = str(data.get("actor_name") or "")
    if actor.startswith(_CONTROLLER_ACTOR):
        _print_controller_notices(data.get("lines", ()))
    if not actor.startswith(_TRAIN_WORKER_ACTOR):
        return
    stream = sys.stderr if data.get("is_err") else sys.stdout
    console = stream.console if isinstance(stream, _Console) else stream
    for line in data.get("lines", ()):
        if line.startswith((":actor_name:", ":task_name:")):
            continue  # Ray's own markers
        # A worker's error lines keep which process wrote them.
        console.write(f"(worker pid={data.get('pid')}) {line}\n" if data.get("is_err")
                      else line + "\n")
    console.flush()


def _print_controller_notices(lines) -> None:
    console = sys.stdout.console if isinstance(sys.stdout, _Console) else sys.stdout
    for line in lines:
        if line.startswith(CONTROLLER_NOTICE):
            console.write(f"[{_driver_command}] {line.removeprefix(CONTROLLER_NOTICE)}\n")
    console.flush()
