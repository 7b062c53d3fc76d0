"""The local runner's worker processes: Beam's SDK harness, with logging set up before Beam.

A root-logger warning written while Beam's modules import makes Python's logging give the root
logger a stderr handler of its own (`logging.basicConfig`). Beam writes such warnings where
`google.cloud` exists without Beam's GCP clients: ray[default]'s dependencies bring the
namespace, and only the dataflow extra brings the clients. Every later line of the harness
("INFO:apache_beam.runners.worker.sdk_worker:Control channel established.", ~25 per worker)
then reached the console of a `prepare` or `demo`. With a handler in place first there is no
such stderr handler; the harness's own records still go to the runner through the Fn API's
logging service (sdk_worker_main adds that handler), and from there to the run's log file.
What is written before that handler exists (the GCP import warnings) is dropped.

The harness also prints a failed bundle's traceback to its stderr, which is the driver's
console (Beam starts the worker with the runner's stderr), right before it logs the same
traceback: ~60 lines ahead of `prepare`'s one-line error. Its stderr is therefore a logger here
(`StderrToLog`), whose records take the logged copy's way, to the run's log file. An uncaught
exception's traceback is written the same way; only what the interpreter writes to the file
descriptor itself (a fatal error) still reaches the console.
"""

from __future__ import annotations

import logging
import sys
import threading

# Beam's harness module, and this one (which runs it): a worker process runs one of them, which
# is how its command line is told from others (cluster.commands.guarded_prepare stops them on
# SIGTERM).
BEAM_HARNESS_MODULE = "apache_beam.runners.worker.sdk_worker_main"
QUIET_HARNESS_MODULE = "bertforge.pipelines.local.quiet_harness"
WORKER_MODULES = (BEAM_HARNESS_MODULE, QUIET_HARNESS_MODULE)


class StderrToLog:
    """A text stream whose writes become log records, one per completed write ending a line."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._pending = ""
        self._lock = threading.RLock()  # the harness's threads share it
        self._logging = False

    def write(self, text: str) -> int:
        with self._lock:
            if self._logging:  # a log handler reporting its own failure: not back into it
                return sys.__stderr__.write(text)
            self._pending += text
            if self._pending.endswith("\n"):
                self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            message, self._pending = self._pending.rstrip("\n"), ""
            if not message or self._logging:
                return
            self._logging = True
            try:
                self._logger.error(message)
            finally:
                self._logging = False

    def isatty(self) -> bool:
        return False


def main() -> None:
    logging.getLogger().addHandler(logging.NullHandler())
    # Under Beam's name: the runner keeps the records of the harness's loggers in the log file.
    sys.stderr = StderrToLog(logging.getLogger("apache_beam.runners.worker.stderr"))
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main(sys.argv)


if __name__ == "__main__":
    main()
