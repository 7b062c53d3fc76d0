"""Records for a command's log file, not its console: one per input file and per shard, which
a large corpus makes by the thousand. A local `prepare` in one process runs its transforms in
the driver, whose console shows every bertforge record (`cluster.launch.worker_output`); on
worker processes (`multi_processing`) or Dataflow they were in the workers' logs already, so
the console is the same whatever the running mode. Log with `extra=LOG_ONLY`."""

LOG_ONLY_ATTRIBUTE = "bertforge_log_only"
LOG_ONLY = {LOG_ONLY_ATTRIBUTE: True}
