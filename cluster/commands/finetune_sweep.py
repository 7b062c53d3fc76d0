"""`bertforge finetune`: a pretrained BERT fine-tuned on a GLUE task or SQuAD with DeepSpeed, on Ray
Train workers (the launch of pretraining, `ray_train.run_on_ray`), or, for one CPU worker on
this machine (the local default), in one child process without Ray (`cluster.launch.local_worker`).

One run per (learning rate, seed): with --sweep every rate of {2e-5, 3e-5, 5e-5} times every seed,
reported as papers report GLUE (the best dev score, the median and the spread). Each run is a
stage of the stage runner, in DIR/runs/lr<rate>-seed<seed>/ (metrics.jsonl, dev predictions,
result.json, the Hugging Face export); the runs not done yet run one after another in one worker
group (its logs in DIR/runs/logs). A rerun into the same DIR reuses finished runs, and may add
seeds or rates. DIR/results.json holds the task, the best run's metrics, the sweep, the config and
the model's provenance; DIR/hf holds the best run's export (hard links) and DIR/dev_predictions.*
is a copy of its predictions.

Inputs are checked on the driver before Ray starts (the model directory, the data files and
their lines), so a mistake is one line at once, not a failing worker group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bertforge.cluster.commands.stage_runner import (
    Stage,
    StageRunner,
    fresh_dir,
    heartbeat,
)
from bertforge.cluster.launch import local_worker
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.cluster.launch.local_worker import run_in_local_process, runs_in_one_local_process
from bertforge.cluster.launch.paths import absolute, refuse_output_in_the_jobs_copy
from bertforge.cluster.launch.ray_train import (
    QUIET_RAY_TRAIN,
    connect,
    restarts_used_up,
    run_on_ray,
)
from bertforge.cluster.launch.worker_output import LOG_DIR
from bertforge.pipelines.contract.disk_space import fullest_of
from bertforge.pipelines.contract.durable_files import write_json_atomic
from bertforge.pipelines.contract.manifest import sha256_file
from bertforge.training.finetune.config import (
    HF_DIR_NAME,
    PAPER_SWEEP,
    RESULT_NAME,
    FinetuneConfig,
    squad_window,
)
from bertforge.training.finetune.load import load_pretrained
from bertforge.training.finetune.task_data import is_squad_split, same_file
from bertforge.training.finetune.tasks import glue_dir_files
from bertforge.training.hf_interop import hf_weights_sha256
from bertforge.training.inputs import check_model_source

RESULTS_NAME = "results.json"
RUNS_DIR = "runs"
# The settings' record of which weights MODEL held (finetune.json): a run, a step, a file.
MODEL_WEIGHTS = "model_weights"
# ... and of what --train and --dev held (their contents' SHA-256): runs reused over an edited
# dev file kept their old scores beside the new file's example counts.
DATA_FILES = "data_files"
# What the workers keep under DIR/runs for themselves: their logs, Ray Train's state, the local
# worker's spec and error. A fine-tune refused in its worker (SQuAD's doc_stride against the
# length, say) leaves these and no result: its settings do not pin the directory.
WORKER_SCRATCH = tuple(os.path.join(RUNS_DIR, name) for name in
                       (LOG_DIR, "ray", local_worker.SPEC_NAME, local_worker.ERROR_NAME))
SQUAD_FILE = os.path.join("squad", "dev-v1.1.json")
SQUAD_PRIMARY = "f1"


def default_data_root() -> str | None:
    """../shared/data from the working directory, else beside this checkout; None if neither."""
    import bertforge.cluster

    # The checkout holds cluster/ (bertforge.cluster's folder, links resolved), wherever in it
    # this module lives.
    checkout = Path(bertforge.cluster.__file__).resolve().parents[1]
    for candidate in (Path("../shared/data"), checkout.parent / "shared" / "data"):
        if candidate.is_dir():
            return str(candidate.resolve())
    return None


def data_note(cfg: FinetuneConfig) -> str | None:
    """Said in the output when train and dev are not two files of their own."""
    if not is_squad_split(cfg):
        return None
    return (f"SQuAD: train and dev are one file, {cfg.train}, split by article "
            f"({cfg.squad_dev_fraction:.0%} of the articles held out as dev, none of them "
            "trained on): the scores are not the official dev set's")


def resolve_data_files(cfg: FinetuneConfig) -> FinetuneConfig:
    """`cfg` with absolute --train/--dev: the task's files under the data root when not given
    (SQuAD: squad/dev-v1.1.json as both, split by article)."""
    if cfg.train is not None and cfg.dev is not None:
        for flag, path in (("--train", cfg.train), ("--dev", cfg.dev)):
            if not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if not cfg.is_squad and same_file(cfg.train, cfg.dev):
            raise ValueError(f"--train and --dev are one file ({cfg.dev}), or copies of it: "
                             "the dev scores would be of examples trained on; give the task's "
                             "train file as --train and its dev file as --dev")
        return dataclasses.replace(cfg, train=os.path.abspath(cfg.train),
                                   dev=os.path.abspath(cfg.dev))
    if cfg.train is not None or cfg.dev is not None:
        raise ValueError("give both --train and --dev, or neither (the task's default files)")
    root = cfg.data_root or default_data_root()
    if root is None:
        raise ValueError(f"no --train/--dev for task {cfg.task}, and no data root: give them, "
                         "or --data-root (a directory holding glue/ and squad/)")
    if cfg.is_squad:
        path = os.path.join(root, SQUAD_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (SQuAD v1.1 dev); give --train and --dev")
        return dataclasses.replace(cfg, train=path, dev=path)
    from bertforge.training.finetune.tasks import task_spec

    train, dev = glue_dir_files(os.path.join(root, "glue"), task_spec(cfg.task))
    return dataclasses.replace(cfg, train=os.path.abspath(train), dev=os.path.abspath(dev))


def check_inputs(cfg: FinetuneConfig, launch: LaunchConfig) -> dict[str, Any]:
    """Read the model's config and vocabulary and every data line, as the workers will; clear
    errors here, before Ray. Returns the model's provenance and the example counts."""
    # Config and vocab first (a model that is not BERT is named as such), then the weights the
    # workers will read.
    pretrained = load_pretrained(cfg.model, random_init=True)
    if not cfg.random_init:
        check_model_source(cfg.model)
    provenance = {**pretrained.provenance, "random_init": cfg.random_init}
    if cfg.is_squad:
        from bertforge.training.finetune.task_data import read_squad_split

        train, dev = read_squad_split(cfg)
    else:
        from bertforge.training.finetune.glue_data import read_examples
        from bertforge.training.finetune.task_data import resolve_spec, subsample, train_examples

        spec = resolve_spec(cfg)
        train = train_examples(cfg, spec)
        dev = subsample(read_examples(cfg.dev, spec), cfg.max_dev_examples)
    if cfg.batch_size % launch.workers:
        raise ValueError(f"--batch-size {cfg.batch_size} is not a multiple of --workers "
                         f"{launch.workers}: each worker takes an equal share of a batch")
    if not cfg.is_squad and len(train) < cfg.batch_size:
        raise ValueError(f"{cfg.train}: {len(train)} training examples are fewer than one batch "
                         f"of {cfg.batch_size}; lower --batch-size")
    positions = pretrained.config.max_position_embeddings
    if cfg.seq_length > positions:
        # The default length (SQuAD's 384) is the task's, not the model's: say what fits.
        raise ValueError(f"max_seq_length {cfg.seq_length} exceeds the model's "
                         f"max_position_embeddings {positions} ({cfg.model}); give "
                         f"{_shorter_flags(cfg, positions)}")
    trained = provenance["positions_trained"]
    if cfg.seq_length > trained and not cfg.random_init:
        # Google's recipe pretrains at 512 tokens last for this reason.
        print(f"[finetune] warning: max_seq_length {cfg.seq_length} is longer than the "
              f"{trained} tokens {cfg.model} was pretrained at: positions {trained + 1}-"
              f"{cfg.seq_length} keep their random initial embeddings; pretrain a phase at "
              f"that length first (the pipeline's [phase2]), or give "
              f"{_shorter_flags(cfg, trained)}", flush=True)
    train_sha256 = sha256_file(cfg.train)  # SQuAD's one file split in two: read once
    dev_sha256 = train_sha256 if cfg.dev == cfg.train else sha256_file(cfg.dev)
    return {"model": provenance, "num_train_examples": len(train), "num_dev_examples": len(dev),
            DATA_FILES: {"train": train_sha256, "dev": dev_sha256}}


def _shorter_flags(cfg: FinetuneConfig, length: int) -> str:
    """The flags that fine-tune at `length` tokens: SQuAD's windows must then fit it too (a
    question of at most half of it where the window left would hold under 2 tokens)."""
    flags = f"--max-seq-length {length}"
    if not cfg.is_squad:
        return flags
    if squad_window(length, cfg.max_query_length) < 2:
        cfg = dataclasses.replace(cfg, max_query_length=max(1, (length - 3) // 2))
        flags += f" --max-query-length {cfg.max_query_length}"
    stride = cfg.doc_stride_for(length)
    return flags + (f" --doc-stride {stride}" if stride != cfg.doc_stride else "")


def run_name(learning_rate: float, seed: int) -> str:
    return f"lr{learning_rate:g}-seed{seed}"


def run_finetune(cfg: FinetuneConfig, launch: LaunchConfig) -> dict[str, Any]:
    """Fine-tune every (learning rate, seed) of `cfg` not done yet in cfg.output; write and
    return results.json's content (see the module docstring)."""
    return run_finetunes([cfg], launch)[0]


def run_finetunes(cfgs: list[FinetuneConfig], launch: LaunchConfig) -> list[dict[str, Any]]:
    """`run_finetune` for several jobs (the demo's: one task from two models) whose pending runs
    share one worker group, so Ray Train's start, the imports and DeepSpeed's set-up are paid
    once. Every job is checked before Ray starts; each keeps its own DIR, stages and results."""
    return run_jobs(open_jobs(cfgs, launch), launch)


def open_jobs(cfgs: list[FinetuneConfig], launch: LaunchConfig) -> list[_Job]:
    """Each fine-tuning job with its inputs checked (`check_inputs`), before any directory of
    its is made: a caller with a directory of its own over them (glue) opens them first."""
    digests: dict[str, str | None] = {}  # glue's tasks share one MODEL: read it once
    jobs = [_Job.open(cfg, launch, digests) for cfg in cfgs]
    if len({job.cfg.output for job in jobs}) < len(jobs):
        raise ValueError("two fine-tuning jobs share one --output directory")
    return jobs


def run_jobs(jobs: list[_Job], launch: LaunchConfig) -> list[dict[str, Any]]:
    """`run_finetunes` of jobs already opened."""
    started = time.time()
    with contextlib.ExitStack() as stack:
        runners = [stack.enter_context(job.stage_runner()) for job in jobs]
        pending = [(job.cfg, lr, seed) for job, runner in zip(jobs, runners, strict=True)
                   for name, (lr, seed) in zip(job.names, job.cfg.runs(), strict=True)
                   if runner.recorded(name) is None]
        if pending:  # one run too: its worker prints its line, the stage only records it
            _run_pending(launch, pending)
        all_results = [job.finish(runner, launch, started if len(jobs) == 1 else None)
                       for job, runner in zip(jobs, runners, strict=True)]
    for results in all_results:
        print(summary_line(results), flush=True)
    return all_results


@dataclasses.dataclass
class _Job:
    """One `bertforge finetune` job: its resolved config and what its inputs hold."""

    cfg: FinetuneConfig
    facts: dict[str, Any]
    weights: dict[str, Any] | None  # MODEL's weights, as its runs are reused for (`weights_key`)

    @classmethod
    def open(cls, cfg: FinetuneConfig, launch: LaunchConfig,
             digests: dict[str, str | None]) -> _Job:
        refuse_output_in_the_jobs_copy(cfg.output, "--output")  # before reading the inputs
        cfg = resolve_data_files(cfg)
        # Relative paths are the user's working directory's, not the workers'.
        cfg = dataclasses.replace(cfg, output=absolute(cfg.output), model=absolute(cfg.model))
        facts = check_inputs(cfg, launch)
        if launch.address:  # no storage support: the workers open the driver's paths
            print(f"[finetune] --address: MODEL, the data files and --output ({cfg.output}) "
                  "must be on a filesystem every node mounts at the same paths", flush=True)
        if data_note(cfg):
            print(f"[finetune] {data_note(cfg)}", flush=True)
        return cls(cfg, facts, weights_key(cfg, facts["model"]["weights"], digests))

    @property
    def names(self) -> list[str]:
        return [run_name(lr, seed) for lr, seed in self.cfg.runs()]

    def stage_runner(self) -> StageRunner:
        # The runs are of MODEL's weights and the data files as they are now: a run trained
        # further, started again (--resume never) or saved over since holds other weights, and
        # an edited file other examples (their finished runs were reused).
        settings = {**self.cfg.settings(), MODEL_WEIGHTS: self.weights,
                    DATA_FILES: self.facts[DATA_FILES]}
        # The weights' time, recorded by an older bertforge, is no longer compared; its
        # records without their SHA-256 are compared by the weights file's name and size.
        return StageRunner(self.cfg.output, "finetune", settings,
                           scratch=WORKER_SCRATCH, heartbeat_seconds=60.0,
                           skip_message="done in an earlier run, reusing it",
                           dir_flag="--output", ignored=(f"{MODEL_WEIGHTS}.modified_ns",),
                           recorded_since=(MODEL_WEIGHTS, DATA_FILES, f"{MODEL_WEIGHTS}.sha256"))

    def finish(self, runner: StageRunner, launch: LaunchConfig,
               started: float | None) -> dict[str, Any]:
        """Record every run (running any still missing), then write results.json. Its seconds:
        since `started`, or, for one of several jobs in one worker group (glue's tasks), its
        own runs' (the group's time was every task's)."""
        cfg = self.cfg
        # A run with its result.json ran in the worker group, whose rank 0 printed its line.
        runner.run([
            Stage(name, lambda lr=lr, seed=seed: _record(cfg, launch, lr, seed),
                  ran_elsewhere=os.path.exists(os.path.join(run_dir_of(cfg, lr, seed),
                                                            RESULT_NAME)))
            for name, (lr, seed) in zip(self.names, cfg.runs(), strict=True)
        ])
        results = self._summary(runner, launch)
        # The best of the runs asked for may be one whose export an earlier sweep removed (it
        # kept only its best's): a rerun with fewer seeds or rates. Fine-tuned again, the same
        # seed gives the same model back, so DIR/hf is still the best run's.
        for _ in cfg.runs():
            best = results["best_run"]
            if os.path.isdir(best["hf_dir"] or ""):
                break
            print(f"[finetune] {run_name(best['learning_rate'], best['seed'])}: the best of "
                  "these runs, its export was removed when an earlier sweep kept only its "
                  "best's; fine-tuning it again for it", flush=True)
            os.remove(os.path.join(best["run_dir"], RESULT_NAME))
            name = run_name(best["learning_rate"], best["seed"])
            runner.state["stages"][name] = _record(cfg, launch, best["learning_rate"],
                                                   best["seed"])
            runner.save()
            results = self._summary(runner, launch)
        results["seconds"] = round(time.time() - started if started is not None else
                                   sum(run.get("seconds") or 0
                                       for run in results["sweep"]["runs"]), 1)
        _publish_best(cfg, results)
        write_json_atomic(os.path.join(cfg.output, RESULTS_NAME), results)
        return results

    def _summary(self, runner: StageRunner, launch: LaunchConfig) -> dict[str, Any]:
        """results.json's content (less its seconds) from the recorded runs."""
        records = [in_place(runner.recorded(name), run_dir_of(self.cfg, lr, seed))
                   for name, (lr, seed) in zip(self.names, self.cfg.runs(), strict=True)]
        return summarise(self.cfg, launch, records, self.facts)


def weights_key(cfg: FinetuneConfig, weights: dict[str, Any] | None,
                digests: dict[str, str | None]) -> dict[str, Any] | None:
    """MODEL's weights as the reuse of its finished runs is keyed: a checkpoint's run id and
    step; a Hugging Face directory's weights file by name, size and SHA-256. Its modification
    time was the key: a file replaced by another of the same size with the same time (`cp -p`,
    `rsync -t`, `touch -r`) had the other model's runs reused. Hashed once per command for
    each MODEL (`digests`), and not for --random-init, which reads no weights."""
    if cfg.random_init or weights is None or "file" not in weights:
        return None if cfg.random_init else weights
    if cfg.model not in digests:
        digests[cfg.model] = hf_weights_sha256(cfg.model)
    return {**weights, "sha256": digests[cfg.model]}


def run_dir_of(cfg: FinetuneConfig, learning_rate: float, seed: int) -> str:
    return os.path.join(cfg.output, RUNS_DIR, run_name(learning_rate, seed))


def in_place(record: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """A run's record with its paths under `run_dir`, where the run is now. The records keep
    the paths the runs were written at: a DIR moved whole then crashed its rerun (the best run's
    predictions "not found", DIR/hf removed on the way), and a copy's DIR/hf pointed into the
    original."""
    paths = {key: os.path.join(run_dir, os.path.basename(record[key]))
             for key in ("hf_dir", "predictions") if record.get(key)}
    return {**record, **paths, "run_dir": run_dir}


def _run_pending(launch: LaunchConfig, runs: list[tuple[FinetuneConfig, float, int]]) -> None:
    """Every run of `runs` (a job's config, a learning rate, a seed) in one worker group (or the
    one local worker process), one after another: the start, the imports and DeepSpeed's set-up
    are paid once, not per run (minutes on a busy CPU). Each run leaves its result.json, which
    its stage then records. The worker logs and Ray Train's state go under the first job's
    DIR/runs."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from bertforge.training.errors import RestartsUsedUp

    # A run with a result.json finished in a call that died before recording it: kept.
    runs = [(cfg, lr, seed) for cfg, lr, seed in runs
            if not os.path.exists(os.path.join(run_dir_of(cfg, lr, seed), RESULT_NAME))]
    if not runs:
        return
    for cfg, learning_rate, seed in runs:
        fresh_dir(run_dir_of(cfg, learning_rate, seed))  # a run that died part-way: start over
    configs = [dataclasses.replace(cfg, learning_rate=lr, seeds=(seed,), sweep=False,
                                   sweep_learning_rates=PAPER_SWEEP,
                                   output=run_dir_of(cfg, lr, seed)).to_dict()
               for cfg, lr, seed in runs]
    runs_root = os.path.join(runs[0][0].output, RUNS_DIR)
    one_job = len({cfg.output for cfg, _, _ in runs}) == 1
    names = [run_name(lr, seed) if one_job else _label(cfg, lr, seed) for cfg, lr, seed in runs]
    worker_config = {"runs": configs, "names": names, "threads": launch.cpus_per_worker,
                     "logs": runs_root}
    local = runs_in_one_local_process(launch)
    where = "one local worker process" if local else "one worker group"
    label = f"{len(runs)} run(s) in {where} ({', '.join(names)})"
    print(f"[finetune] {label}", flush=True)
    with heartbeat("finetune", label, every_seconds=60.0):
        # No Ray: its processes cost one worker on few cores (cluster.launch.local_worker).
        if local:
            try:
                run_in_local_process(_worker_main, worker_config, launch, runs_root)
            except RestartsUsedUp as error:
                raise RestartsUsedUp(f"{error}; {_WHAT_A_SWEEP_LEFT}") from None
            return
        connect(launch)
        try:
            run_on_ray(
                _worker_main, {**worker_config, "ray": True}, launch,
                # Ray Train's own state in DIR/runs/ray; a restarted worker group skips
                # finished runs.
                RunConfig(name="ray", storage_path=runs_root, logging_config=QUIET_RAY_TRAIN,
                          failure_config=FailureConfig(max_failures=launch.max_failures)),
            )
        except WorkerGroupError as error:  # a user error's is a UserInputError by now
            raise RestartsUsedUp(restarts_used_up("fine-tuning", launch,
                                                  _WHAT_A_SWEEP_LEFT)) from error


# What a fine-tuning whose worker failed past --max-failures leaves for the same command.
_WHAT_A_SWEEP_LEFT = ("the same command runs again what did not finish (each finished run is "
                      "reused)")


def _label(cfg: FinetuneConfig, learning_rate: float, seed: int) -> str:
    """A run named with its job's directory (several jobs in one group)."""
    return os.path.relpath(run_dir_of(cfg, learning_rate, seed), os.path.dirname(cfg.output))


def _record(cfg: FinetuneConfig, launch: LaunchConfig, learning_rate: float,
            seed: int) -> dict[str, Any]:
    """A run's record: the result.json its rank 0 wrote (running it now if it has none)."""
    run_dir = run_dir_of(cfg, learning_rate, seed)
    path = os.path.join(run_dir, RESULT_NAME)
    if not os.path.exists(path):  # written last, so a run that has it is complete
        _run_pending(launch, [(cfg, learning_rate, seed)])
    with open(path, encoding="utf-8") as f:
        record = {**json.load(f), "run_dir": run_dir}
    # The run's own duration, measured where it ran (its stage may only be recording it).
    record.setdefault("seconds", record.get("run_seconds", record.get("train_seconds")))
    return record


def _worker_main(worker_config: dict[str, Any]) -> None:
    """Entry point on every worker: a Ray Train worker (`ray` in the config: the process group
    is already set up) or the one local worker process (`cluster.launch.local_worker`)."""
    import gc

    import torch

    from bertforge.cluster.launch.local_worker import stop_if_asked, stops_held
    from bertforge.cluster.launch.worker_output import quiet_worker

    torch.set_num_threads(worker_config["threads"])
    if worker_config.get("ray"):
        import ray.train

        rank = ray.train.get_context().get_world_rank()
    else:
        rank = 0
    # Library chatter to DIR/runs/logs/worker-RANK.log only, before DeepSpeed's import logs any.
    quiet_worker(worker_config["logs"], rank, verbose=worker_config.get("verbose", False))
    from bertforge.training.distributed import barrier
    from bertforge.training.engine import ensure_process_group

    ensure_process_group()  # Ray Train's group, or a 1-rank one in the local process
    if worker_config.get("ray"):
        import ray.train.torch

        device = ray.train.torch.get_device()
    else:
        device = torch.device("cpu")

    names = worker_config.get("names") or [os.path.basename(v["output"])
                                           for v in worker_config["runs"]]
    for number, (values, name) in enumerate(zip(worker_config["runs"], names, strict=True), 1):
        stop_if_asked()  # a stop that landed in the last run's clean-up (its gc) is not lost
        if os.path.exists(os.path.join(values["output"], RESULT_NAME)):
            continue  # finished before this worker group restarted
        # A restarted group re-runs a run its predecessor left half done: start it over, or
        # its metrics.jsonl would hold the first attempt's steps too (the driver cleans only
        # before the first group). Every rank waits, so none reads the run's old files.
        if rank == 0:
            fresh_dir(values["output"])
        barrier(device)
        started = time.time()
        record = fine_tune_one(values)
        if rank == 0:  # the run's line now, with its real duration, not when the group ends
            _finished(values["output"], f"[{number}/{len(names)}] {name}", record,
                      time.time() - started)
        with stops_held():
            gc.collect()  # the run's engine and model, before the next one's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fine_tune_one(values: dict[str, Any]) -> dict[str, Any]:
    """One run of a worker's list; what no retry can fix raised as a user error (the worker
    group is then not restarted): bad inputs, and a full disk, into which each of the local
    worker's four attempts fine-tuned from the start before."""
    from bertforge.training.errors import UserInputError, as_user_error, disk_full, first_line
    from bertforge.training.finetune.loop import finetune

    try:
        return finetune(FinetuneConfig.from_dict(values))
    except ValueError as error:
        raise as_user_error(error) from None
    except Exception as error:
        if not disk_full(error):
            raise
        where = fullest_of(values["output"], tempfile.gettempdir())
        raise UserInputError(
            f"no space left on the disk of {where} ({first_line(error)}): make room there "
            "and the same command continues (finished runs are kept)") from error


def _finished(run_dir: str, label: str, record: dict[str, Any], seconds: float) -> None:
    """Rank 0's line for a finished run, and its duration kept in its result.json."""
    from bertforge.training.metrics import console

    path = os.path.join(run_dir, RESULT_NAME)
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    write_json_atomic(path, {**result, "run_seconds": round(seconds, 1)})
    if result.get("diverged"):
        console(f"[finetune] {label}: finished in {seconds:.1f} s, DIVERGED (the loss or the dev "
                "logits became NaN): not scored, no model kept; a lower --lr trains")
        return
    scores = ", ".join(f"{k} {v:.4f}" for k, v in record["metrics"].items())
    console(f"[finetune] {label}: finished in {seconds:.1f} s ({scores}{chance_note(result)})")
    if result.get("single_label") is not None:
        console(f"[finetune] {label}: predicted {result['single_label']!r} for every dev "
                "example: it learned nothing (the BERT paper restarts such runs: other "
                "--seeds, another --lr, or --sweep)")


def chance_note(result: dict[str, Any]) -> str:
    """"; always 'positive': accuracy 0.5092", what the dev set's most frequent label scores,
    beside a classification's scores; "" for SQuAD, a regression, or a record made before."""
    chance = result.get("chance")
    if not chance:
        return ""
    scores = ", ".join(f"{k} {v:.4f}" for k, v in chance["metrics"].items())
    return f"; always {chance['label']!r}: {scores}"


def primary_metric(cfg: FinetuneConfig) -> str:
    if cfg.is_squad:
        return SQUAD_PRIMARY
    from bertforge.training.finetune.task_data import resolve_spec

    return resolve_spec(cfg).primary_metric


def sweep_statistics(scores: list[float]) -> dict[str, float]:
    """Best, median and spread of the runs' dev scores (every GLUE metric: higher is better)."""
    return {
        "best": max(scores), "median": statistics.median(scores),
        "mean": statistics.fmean(scores), "min": min(scores), "max": max(scores),
        "std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
    }


def summarise(cfg: FinetuneConfig, launch: LaunchConfig, records: list[dict[str, Any]],
              facts: dict[str, Any]) -> dict[str, Any]:
    primary = primary_metric(cfg)
    scored = [record for record in records if not record.get("diverged")]
    if not scored:
        raise ValueError(
            f"every run of {cfg.output} diverged (its loss or dev logits became NaN), so none "
            f"has a score: rerun with a lower --lr (the BERT paper's: 2e-5 to 5e-5){_lr_hint(cfg)}")
    scores = [record["metrics"][primary] for record in scored]
    best = best_run(scored, primary)
    return {
        "task": cfg.task,
        "primary_metric": primary,
        "score": best["metrics"][primary],
        "metrics": best["metrics"],
        "best_run": {key: best[key] for key in ("learning_rate", "seed", "run_dir", "hf_dir",
                                                "predictions")},
        "sweep": {
            # The statistics are the scored runs'; a diverged run has none to give.
            "num_runs": len(records), "num_diverged": len(records) - len(scored),
            **sweep_statistics(scores),
            "runs": [{"learning_rate": r["learning_rate"], "seed": r["seed"],
                      "score": r["metrics"].get(primary), "metrics": r["metrics"],
                      "diverged": bool(r.get("diverged")),
                      "single_label": r.get("single_label"),
                      "train_seconds": r["train_seconds"], "seconds": r.get("seconds"),
                      "run_dir": r["run_dir"]}
                     for r in records],
        },
        "output": cfg.output,
        "hf_dir": os.path.join(cfg.output, HF_DIR_NAME),
        "predictions": os.path.join(cfg.output, os.path.basename(best["predictions"])),
        # The dev set's, so every run's; the best run's word on whether it learned.
        **{key: best[key] for key in ("chance", "single_label") if key in best},
        # What the best run trained from (a run directory's newest when it started: beside a
        # running train a later run may have started from a newer checkpoint; each run's
        # result.json names its own). Runs recorded before runs named it: the driver's check.
        "model": best.get("model", facts["model"]),
        "data": {"train": cfg.train, "dev": cfg.dev, "note": data_note(cfg),
                 "sha256": facts[DATA_FILES],
                 "num_train_examples": facts["num_train_examples"],
                 "num_dev_examples": facts["num_dev_examples"]},
        "training": {key: best[key] for key in ("steps", "epochs", "world_size", "precision",
                                                "zero_stage", "final_train_loss")},
        "train_seconds": round(sum(r["train_seconds"] for r in records), 1),
        "config": cfg.to_dict(),
        "launch": dataclasses.asdict(launch),
    }


def best_run(scored: list[dict[str, Any]], primary: str) -> dict[str, Any]:
    """The run of the highest score; of equal ones, the first whose export is still there
    (a sweep kept only its best's export: rerun with its rates in another order, the tie went
    to a run without one, and DIR/hf was lost), else the first in runs() order."""
    top = max(record["metrics"][primary] for record in scored)
    tied = [record for record in scored if record["metrics"][primary] == top]
    return next((record for record in tied if os.path.isdir(record.get("hf_dir") or "")),
                tied[0])


def _lr_hint(cfg: FinetuneConfig) -> str:
    rates = cfg.sweep_learning_rates if cfg.sweep else (cfg.learning_rate,)
    return f" (asked: {', '.join(f'{rate:g}' for rate in rates)})"


def _publish_best(cfg: FinetuneConfig, results: dict[str, Any]) -> None:
    """DIR/hf: the best run's export, DIR/dev_predictions.* its predictions; the other runs'
    exports are removed unless --keep-all-models."""
    best = results["best_run"]
    published = results["hf_dir"]
    if os.path.isdir(best["hf_dir"]):
        _hard_linked_copy(best["hf_dir"], published)
    else:  # not even fine-tuned again (`finish`): said, never a link to nothing
        _remove(published)
        print(f"[finetune] the best run's export {best['hf_dir']} is missing, so {published} "
              "is not made", flush=True)
        results["hf_dir"] = None
    shutil.copyfile(best["predictions"], results["predictions"])
    if cfg.keep_all_models:
        return
    for run in results["sweep"]["runs"]:
        if run["run_dir"] != best["run_dir"]:
            shutil.rmtree(os.path.join(run["run_dir"], HF_DIR_NAME), ignore_errors=True)


def _hard_linked_copy(source: str, target: str) -> None:
    """`target` (replaced whole) holds `source`'s files as hard links: no second copy on the
    disk, and, unlike the relative symbolic link DIR/hf was, it survives `cp -r DIR/hf` and a
    move of DIR alike. A filesystem without hard links gets copies."""
    def link_or_copy(file: str, copy: str) -> None:
        try:
            os.link(file, copy)
        except OSError:
            shutil.copy2(file, copy)

    building = f"{target}.tmp"
    _remove(building)
    shutil.copytree(source, building, copy_function=link_or_copy)
    _remove(target)  # a directory, or the link an older bertforge made
    os.rename(building, target)


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def summary_line(results: dict[str, Any]) -> str:
    """One line: the task, the best score and run, the sweep's spread, the model, the time."""
    sweep, best, primary = results["sweep"], results["best_run"], results["primary_metric"]
    line = (f"[finetune] {results['task']}: {primary} {results['score']:.4f} "
            f"(lr {best['learning_rate']:g}, seed {best['seed']})")
    if sweep["num_runs"] > 1:
        line += (f"; {sweep['num_runs']} runs: median {sweep['median']:.4f}, "
                 f"spread {sweep['min']:.4f} to {sweep['max']:.4f} (std {sweep['std']:.4f})")
    diverged = [f"lr {run['learning_rate']:g} seed {run['seed']}"
                for run in sweep.get("runs", ()) if run.get("diverged")]
    if diverged:
        line += f", {len(diverged)} of them diverged and left out ({'; '.join(diverged)})"
    others = ", ".join(f"{k} {v:.4f}" for k, v in results["metrics"].items() if k != primary)
    if others:
        line += f"; {others}"
    line += chance_note(results)
    if results.get("single_label") is not None:
        line += f" (it predicted {results['single_label']!r} for every dev example)"
    model = results["model"]
    origin = "random init of " if model["random_init"] else ""
    line += (f"; from {origin}{model['source']} ({model['kind']}); "
             f"{results['seconds']:.0f} s; {results['output']}/{RESULTS_NAME}")
    return line
