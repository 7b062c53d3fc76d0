"""A worker process's warnings and errors from bertforge's own code, back under their names.

With `--direct_running_mode multi_processing` (the README's local prepare) Beam's workers are
other processes. Their records reach the driver through the Fn API's logging service, which
logs each as one `Worker: <the LogEntry as protobuf text>` record of its own logger (from
WARNING up: its INFO ones are under Beam's level). So the warnings a one-process run prints
and that ask the user to act (an input read as a sentence a line that looks hard-wrapped, a
file named `.jsonl` holding XML) stayed in the run's log file, inside protobuf text, never on
the console.

`relay_our_worker_records` turns such a record of our code back into the record the worker
made (the logger its module is, its level, its message), which then takes our records' way:
the console, with the command's prefix, and the log. Beam's own worker records are left as
they were. Our INFO lines (each input file's format, each shard written) stay in the workers,
as before: one line per file or shard is no console line for a corpus of thousands of files.
"""

from __future__ import annotations

import logging
import os

from apache_beam.portability.api import beam_fn_api_pb2
from google.protobuf import text_format

# The logger of the logging service that multi_processing's workers send their records to.
SERVICE_LOGGER = "apache_beam.runners.portability.local_job_service"
_WORKER_PREFIX = "Worker: "
_OUR_PACKAGE = f"{os.sep}bertforge{os.sep}"
# Ours by file, Beam's by content: the quiet harness logs what Beam's harness writes to its
# stderr (a failed bundle's traceback) under Beam's logger name, for the log file only.
_BEAMS_STDERR = os.path.join("pipelines", "local", "quiet_harness.py")


class _OurWorkerRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        _as_our_record(record)
        return True


def relay_our_worker_records() -> None:
    """Install the filter on the service's logger (once per process)."""
    service = logging.getLogger(SERVICE_LOGGER)
    if not any(isinstance(f, _OurWorkerRecords) for f in service.filters):
        service.addFilter(_OurWorkerRecords())


def _as_our_record(record: logging.LogRecord) -> None:
    """Rewrite `record` in place into the worker's own record when that was one of our code's."""
    if record.msg != _WORKER_PREFIX + "%s" or len(record.args or ()) != 1:
        return
    entry = beam_fn_api_pb2.LogEntry()
    try:
        text_format.Parse(str(record.args[0]), entry)
    except text_format.ParseError:
        return
    path, _, line = entry.log_location.rpartition(":")
    if _OUR_PACKAGE not in path or not path.endswith(".py") or path.endswith(_BEAMS_STDERR):
        return
    module = path[path.rindex(_OUR_PACKAGE) + 1 : -len(".py")].replace(os.sep, ".")
    record.name, record.msg, record.args = module, entry.message, ()
    record.pathname, record.filename = path, os.path.basename(path)
    record.module, record.lineno = module.rsplit(".", 1)[-1], int(line) if line.isdigit() else 0
