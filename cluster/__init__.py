"""The `bertforge` command line and everything it runs beyond the data and the model.

Rooms, each importing only the rooms below it (tests/test_layering.py):

- `cli.py`: the command line, thin handlers over the rooms and pipelines/, training/;
- `demo/`: `bertforge demo`, its built-in corpus and the SST-2 subset it ships;
- `commands/`: what the longer commands do: the stage runner behind `demo`, `pipeline`,
  `finetune` and `glue`, the chain's stages, `prepare` with its dataset guard, sweeps;
- `launch/`: where and how a run goes: Ray Train (`TorchTrainer`), a private local Ray, Ray Jobs
  submission, one local worker process, checkpoints in Ray storage, the retry policy, what the
  console shows of the workers;
- `safety/`: files nobody loses: one writer per run or dataset directory (`run_lock`), no
  dataset replaced unasked or under a reader (`dataset_guard`), records written atomically.
"""
