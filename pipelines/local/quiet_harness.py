"""The local runner's worker processes: Beam's SDK harness, with logging set up before Beam.

A root-logger warning written while Beam's modules import makes Python's logging give the root
logger a stderr handler of its own (`logging.basicConfig`). Beam writes such warnings where
`google.cloud` exists without Beam's GCP clients: ray[default]'s dependencies bring the
namespace, and only the dataflow extra brings the clients. Every later line of the harness
("INFO:apache_beam.runners.worker.sdk_worker:Control channel established.", ~25 per worker)
then reached the console of a `prepare` or `demo`. With a handler in place first there is no
such stderr handler; the harness's own records still go to the runner through the Fn API's
logging service (sdk_worker_main adds that handler), and from there to the run's log file.
What is written before that handler exists (the GCP import warnings) is dropped. An uncaught
exception's traceback is not logging: it still reaches stderr.
"""

from __future__ import annotations

import logging
import sys

# Beam's harness module, and this one (which runs it): a worker process runs one of them, which
# is how its command line is told from others (cluster.dataset_guard stops them on SIGTERM).
BEAM_HARNESS_MODULE = "apache_beam.runners.worker.sdk_worker_main"
QUIET_HARNESS_MODULE = "bertforge.pipelines.local.quiet_harness"
WORKER_MODULES = (BEAM_HARNESS_MODULE, QUIET_HARNESS_MODULE)


def main() -> None:
    logging.getLogger().addHandler(logging.NullHandler())
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main(sys.argv)


if __name__ == "__main__":
    main()
