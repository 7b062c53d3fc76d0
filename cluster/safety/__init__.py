"""Files nobody loses: one writer per run or dataset directory (`run_lock`), no dataset replaced
unasked or under a run that reads it (`dataset_guard`); records are written whole by
`pipelines.contract.durable_files`, which prepare and the checkpoints share."""
