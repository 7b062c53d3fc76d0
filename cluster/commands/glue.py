"""`bertforge glue`: every GLUE task found in the GLUE directory fine-tuned from one model, and one
table in the GLUE paper's layout (a column per task with its metric(s), then the average).

Each task is a fine-tuning job into DIR/<task>/ (its own results.json, predictions and Hugging
Face export) and a stage of the stage runner. The tasks not done yet run in one local process
or one Ray Train worker group (`run_jobs`: the start and set-up paid once, not per task), so a
rerun into the same DIR skips finished tasks, and a task interrupted part-way reuses its finished
(learning rate, seed) runs. DIR/glue.json is the
job's record: its settings, each task's record (`stages`) and the table (`glue`).

The table's numbers are the GLUE paper's: dev metrics x 100; MRPC F1/accuracy; STS-B
Pearson/Spearman; the average over tasks of each task's score, the mean of its metrics for the
two-metric tasks (how the GLUE benchmark computes its score). A task whose files are missing is
shown as '-', and the average says over how many tasks it was taken.
"""

from __future__ import annotations

import os
import time
from dataclasses import MISSING as MISSING_DEFAULT
from dataclasses import dataclass, fields
from typing import Any

from bertforge.cluster.launch.paths import absolute, refuse_output_in_the_jobs_copy
from bertforge.pipelines.contract.config_fields import (
    NO_FLAG,
    RERUN_MAY_CHANGE,
    fields_marked,
    option,
    without_marked,
)
from bertforge.training.finetune import tasks
from bertforge.training.finetune.config import PER_TASK, SELECTS_RUNS, FinetuneConfig

DEFAULT_GLUE_OUTPUT = "bertforge-glue"
MISSING = "-"


@dataclass(frozen=True)
class GlueColumn:
    task: str  # a key of tasks.GLUE_TASKS
    title: str
    metrics: tuple[str, ...]  # shown a/b in this order
    metric_label: str


# The GLUE paper's order (single sentence, similarity and paraphrase, inference), limited to the
# tasks whose data can be here (QQP, MNLI, QNLI and WNLI are not).
GLUE_COLUMNS = (
    GlueColumn("cola", "CoLA", (tasks.MCC,), "MCC"),
    GlueColumn("sst2", "SST-2", (tasks.ACCURACY,), "acc"),
    GlueColumn("mrpc", "MRPC", (tasks.F1, tasks.ACCURACY), "F1/acc"),
    GlueColumn("stsb", "STS-B", (tasks.PEARSON, tasks.SPEARMAN), "P/S corr"),
    GlueColumn("rte", "RTE", (tasks.ACCURACY,), "acc"),
)


@dataclass
class GlueConfig:
    """`bertforge glue`'s own settings; the fine-tuning flags go to every task (`finetune`)."""

    model: str = option(help="a bertforge checkpoint, a run directory or a Hugging Face BERT "
                        "directory")
    output: str = option(DEFAULT_GLUE_OUTPUT, "one directory per task, glue.json and the table "
                         "go here")
    glue_dir: str | None = option(help="the GLUE data: <dir>/SST-2/train.tsv, ... (default: "
                                  "../shared/data/glue from the working directory, else "
                                  "shared/data/glue beside bertforge's checkout)")
    tasks: tuple[str, ...] = option((), "only these tasks (default: every task whose train and "
                                    "dev files are there)")
    # FinetuneConfig's recipe (its fields not marked PER_TASK), applied to every task; its
    # fields are flags of their own (cli: `add_flags(..., without=(PER_TASK,))`).
    finetune: dict[str, Any] = option({}, "fine-tuning settings for every task (the "
                                      "FinetuneConfig flags)", marks=(NO_FLAG,))

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("--model is required: the pretrained model to fine-tune")
        for name in self.tasks:
            if tasks.canonical_task_name(name) not in tasks.GLUE_TASKS:
                raise ValueError(
                    f"--tasks: {name!r} is no GLUE task; bertforge glue runs "
                    f"{', '.join(tasks.GLUE_TASKS)} (SQuAD and custom tasks: bertforge finetune)")
        self.tasks = tuple(tasks.task_spec(name).name for name in self.tasks)
        per_task = sorted(set(self.finetune) & set(fields_marked(FinetuneConfig, PER_TASK)))
        if per_task:
            raise ValueError(f"{', '.join(per_task)}: set per task by bertforge glue")


# --- the table (pure) ---------------------------------------------------------------------


def task_score(column: GlueColumn, metrics: dict[str, float]) -> float:
    """A task's one number for the average: the mean of its metrics, x 100."""
    return 100.0 * sum(metrics[m] for m in column.metrics) / len(column.metrics)


def glue_average(results: dict[str, dict[str, float]]) -> float | None:
    """The mean task score over the tasks in `results` ({task: metrics}); None without any."""
    scores = [task_score(c, results[c.task]) for c in GLUE_COLUMNS if c.task in results]
    return sum(scores) / len(scores) if scores else None


def _cell(column: GlueColumn, metrics: dict[str, float] | None) -> str:
    if metrics is None:
        return MISSING
    return "/".join(f"{100.0 * metrics[m]:.1f}" for m in column.metrics)


def format_glue_table(results: dict[str, dict[str, float]], name: str,
                      chance: dict[str, dict[str, float]] | None = None) -> str:
    """The GLUE paper's layout: a header of task names and metrics, then `name`'s row of dev
    scores x 100, '-' for a task not in `results`, and the average over the tasks present.
    With `chance` for every task of `results` (None: a record made before it was measured), a
    row under it of what always answering each dev set's commonest label scores (SuperGLUE's
    "most frequent class"), averaged the same way."""
    header = ["", *(c.title for c in GLUE_COLUMNS), "Average"]
    metrics = ["", *(c.metric_label for c in GLUE_COLUMNS), ""]
    rows = [_row(results, name)]
    if results and chance is not None and all(chance.get(task) for task in results):
        rows.append(_row(chance, MOST_FREQUENT_CLASS))
    lines = (header, metrics, *rows)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True))
                     .rstrip() for line in lines)


MOST_FREQUENT_CLASS = "most frequent class"


def _row(results: dict[str, dict[str, float]], name: str) -> list[str]:
    average = glue_average(results)
    present = sum(c.task in results for c in GLUE_COLUMNS)
    average_cell = MISSING if average is None else f"{average:.1f}"
    if 0 < present < len(GLUE_COLUMNS):
        average_cell += f" ({present} of {len(GLUE_COLUMNS)} tasks)"
    return [name, *(_cell(c, results.get(c.task)) for c in GLUE_COLUMNS), average_cell]


def chance_metrics(task: str, record: dict[str, Any]) -> dict[str, float] | None:
    """A task's most-frequent-class scores from its record; a constant answer correlates with
    nothing, so STS-B's are 0 (the convention of GLUE's correlation metrics here); None for a
    record made before runs measured it."""
    if tasks.GLUE_TASKS[task].is_regression:
        return {metric: 0.0 for metric in tasks.GLUE_TASKS[task].metrics}
    return record.get("chance")


def model_name(model: str, random_init: bool) -> str:
    """The table's row label: the model directory's name (its parent's too for `hf`-like
    names, which say little alone)."""
    path = os.path.normpath(os.path.abspath(model))
    name = os.path.basename(path)
    if name in ("hf", "model", "checkpoint") or name.startswith("checkpoint"):
        name = f"{os.path.basename(os.path.dirname(path))}/{name}"
    return f"random init of {name}" if random_init else name


# --- the job ------------------------------------------------------------------------------


# GLUE is not shipped (the demo's SST-2 subset only): where to get it, said where it is missing.
GET_GLUE = ("give --glue-dir, a folder holding <Task>/train.tsv and dev.tsv for CoLA, SST-2, "
            "MRPC, STS-B and RTE (GLUE's layout). Get it with GLUE's download_glue_data.py "
            "(github.com/nyu-mll/GLUE-baselines), or write Hugging Face's nyu-mll/glue dataset "
            "to TSV in that layout")


def resolve_glue_dir(glue_dir: str | None) -> str:
    if glue_dir is not None:
        if not os.path.isdir(glue_dir):
            what = "a file, not a directory" if os.path.isfile(glue_dir) else "no such directory"
            raise ValueError(f"--glue-dir {glue_dir}: {what}")
        return os.path.abspath(glue_dir)
    from bertforge.cluster.commands.finetune_sweep import default_data_root

    root = default_data_root()
    if root is None or not os.path.isdir(os.path.join(root, "glue")):
        raise ValueError(f"no GLUE data: {GET_GLUE}")
    return os.path.join(root, "glue")


def task_configs(config: GlueConfig, glue_dir: str) -> dict[str, FinetuneConfig]:
    """{task: its FinetuneConfig}, for the tasks asked for (or all whose files are there); any
    mistake in the fine-tuning settings is one error here, before anything runs."""
    names = list(config.tasks) or tasks.available_glue_tasks(glue_dir)
    if not config.tasks:
        for name, missing in tasks.incomplete_glue_tasks(glue_dir).items():
            print(f"[glue] {name}: left out, {os.path.join(glue_dir, missing)} is missing",
                  flush=True)
    if not names:
        raise ValueError(f"{glue_dir}: no GLUE task's train.tsv and dev.tsv are there "
                         f"(looked for {', '.join(c.title for c in GLUE_COLUMNS)}); {GET_GLUE}")
    configs = {}
    for name in names:
        train, dev = tasks.glue_dir_files(glue_dir, tasks.task_spec(name))
        configs[name] = FinetuneConfig(
            task=name, model=absolute(config.model), train=train, dev=dev,
            output=os.path.join(os.path.abspath(config.output), name), **config.finetune)
    return configs


def run_glue(config: GlueConfig, launch: Any) -> dict[str, Any]:
    """Fine-tune every task not done yet in config.output; print and return the table record."""
    from bertforge.cluster.commands.finetune_sweep import open_jobs, run_jobs
    from bertforge.cluster.commands.stage_runner import Stage, StageRunner

    started = time.time()
    refuse_output_in_the_jobs_copy(config.output, "--output")  # before reading the inputs
    glue_dir = resolve_glue_dir(config.glue_dir)
    configs = task_configs(config, glue_dir)
    # Every task's inputs (the model, its files, the batch against --workers) checked before
    # DIR is made: a refused glue used to leave DIR with glue.json and logs/ behind.
    jobs = dict(zip(configs, open_jobs(list(configs.values()), launch), strict=True))
    settings = {
        "model": os.path.abspath(config.model), "glue_dir": glue_dir, "tasks": list(configs),
        "finetune": without_marked(config.finetune, FinetuneConfig, RERUN_MAY_CHANGE),
    }
    # Which tasks, and which (learning rate, seed) runs of each, may change: a rerun asking
    # for more (a task whose files came since, another seed) runs what is missing, as
    # `finetune` does, and the order they are named in changes nothing. (They were "other
    # settings" before: refused.)
    selection = ("tasks", *(f"finetune.{field}" for field in fields_marked(FinetuneConfig,
                                                                           SELECTS_RUNS)))
    # The flags typed are recorded; one typed at its default value is the same recipe.
    defaults = {f"finetune.{field.name}": field.default for field in fields(FinetuneConfig)
                if field.default is not MISSING_DEFAULT}
    with StageRunner(config.output, "glue", settings, heartbeat_seconds=120.0,
                     skip_message="done in an earlier run, reusing it",
                     dir_flag="--output", ignored=selection, defaults=defaults) as runner:
        # Every task not done yet in one worker group, or the one local worker process (its
        # start paid once); each task then becomes a stage. A failed group leaves the finished
        # tasks' runs for a rerun.
        pending = [name for name in configs
                   if not _is_current(runner.recorded(name), jobs[name])]
        finished = dict(zip(pending, run_jobs([jobs[name] for name in pending], launch),
                            strict=True)) if pending else {}
        # A task fine-tuned just now printed its runs' lines as they finished: its stage only
        # records it, with the runs' own durations.
        runner.run([Stage(name, lambda name=name: _task_record(finished[name]),
                          is_done=lambda name=name: name not in pending,
                          ran_elsewhere=name in finished) for name in configs])
        results = {name: runner.recorded(name)["metrics"] for name in configs}
        random_init = bool(config.finetune.get("random_init", False))
        chance = {name: chance_metrics(name, runner.recorded(name)) for name in configs}
        table = format_glue_table(results, model_name(config.model, random_init), chance)
        runner.state["glue"] = {
            "model": os.path.abspath(config.model), "random_init": random_init,
            "glue_dir": glue_dir, "results": results, "average": glue_average(results),
            "most_frequent_class": chance,
            "tasks_run": list(configs),
            "tasks_missing": [c.task for c in GLUE_COLUMNS if c.task not in results],
            "table": table, "this_run_seconds": round(time.time() - started, 1),
        }
        runner.save()
    print(f"\nGLUE dev ({os.path.join(runner.root, 'glue.json')})\n{table}", flush=True)
    return runner.state["glue"]


def _is_current(record: dict[str, Any] | None, job: Any) -> bool:
    """Whether a task's record holds the very (learning rate, seed) runs `job` asks for, on
    the data files as they are now. A rerun with fewer seeds printed the larger sweep's best,
    and one over an edited dev file its old scores. (A record from before the runs or the
    data were recorded: done, as then.)"""
    if record is None:
        return False
    from bertforge.cluster.commands.finetune_sweep import DATA_FILES

    if record.get(DATA_FILES, job.facts[DATA_FILES]) != job.facts[DATA_FILES]:
        return False  # its fine-tuning job says how it differs
    if "runs" not in record:
        return True
    return {tuple(run) for run in job.cfg.runs()} == {tuple(run) for run in record["runs"]}


def _task_record(results: dict[str, Any]) -> dict[str, Any]:
    """What glue.json keeps of a task's results.json."""
    from bertforge.cluster.commands.finetune_sweep import DATA_FILES

    return {
        "runs": [[run["learning_rate"], run["seed"]] for run in results["sweep"]["runs"]],
        "metrics": results["metrics"], "primary_metric": results["primary_metric"],
        "chance": results.get("chance", {}).get("metrics"),
        "score": results["score"], "sweep": {k: v for k, v in results["sweep"].items()
                                             if k != "runs"},
        "results": os.path.join(results["output"], "results.json"),
        DATA_FILES: results["data"]["sha256"],
        "num_train_examples": results["data"]["num_train_examples"],
        "train_seconds": results["train_seconds"],
        "seconds": round(sum(run.get("seconds") or 0.0 for run in results["sweep"]["runs"]), 1),
    }
