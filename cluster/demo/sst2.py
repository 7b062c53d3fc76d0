"""The demo's last stage: is the model it just pretrained any use? SST-2, three ways, one budget.

1. fine-tuned from the demo's Hugging Face export (`run_finetunes`, DeepSpeed; both fine-tunes
   in one worker: the local default, one process without Ray, `cluster.launch.local_worker`);
2. fine-tuned from the same architecture and vocabulary with random weights (random_init), with
   the same examples, steps and seed;
3. a bag-of-words logistic regression (`bow_baseline`) on the same examples.

SST-2 ships with bertforge for this (`data/sst2/`, see its SOURCE.md): the 2,000 lines the
demo trains on and the whole dev set, so the stage runs on a fresh clone; `--glue-dir` points it
at the whole of GLUE's SST-2 instead.

Both fine-tunes run at every learning rate of the budget, and each model is read at its best
dev accuracy (the BERT paper's choice among its rates): a learning rate suits one model and not
the other (at 3e-4 random init stayed at chance; at 1e-3 it passed the pretrained model), so
one rate for both compared the rate as much as the weights.

All three train on the same fixed random subset of SST-2's train lines of at least
`min_words` words (the demo's time budget; `task_data.train_examples`: most of SST-2's train
lines are short phrases, its dev set is whole sentences) and score SST-2's whole dev set (872
sentences) unless told otherwise.
The demo's vocabulary is trained on Python docstrings, not film reviews: the comparison says what
a few CPU minutes of pretraining on unrelated prose give a small model, no more.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from bertforge.training.finetune.config import FinetuneConfig

SST2_TRAIN_SENTENCES = 67_349  # GLUE's SST-2 train.tsv (DOWNSTREAM-SOURCES.md)
# The shipped subset: the demo's default draw (2,000 of SST-2's 25,152 train lines of 10 words
# or more, task_data's fixed subset seed) and the whole dev set; see data/sst2/SOURCE.md. Package
# data (setup.py), found beside this module wherever bertforge is installed.
SHIPPED_SST2_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sst2")
SHIPPED_TRAIN_LINES = 2_000
SHIPPED_MIN_WORDS = 10
SHIPPED_DRAWN_FROM = 25_152


@dataclasses.dataclass(frozen=True)
class FinetuneBudget:
    """The same for both models (DemoConfig's finetune_* fields)."""

    train_examples: int
    min_words: int | None
    dev_examples: int | None
    epochs: float
    max_seq_length: int
    batch_size: int
    learning_rates: tuple[float, ...]  # each model at each; its best dev score counts
    seed: int
    workers: int


def sst2_files(glue_dir: str | None) -> tuple[str, str] | None:
    """(train.tsv, dev.tsv) of SST-2 under glue_dir, or None where either is missing; without
    glue_dir, the subset shipped with bertforge."""
    if glue_dir is None:
        return (os.path.join(SHIPPED_SST2_DIR, "train.tsv"),
                os.path.join(SHIPPED_SST2_DIR, "dev.tsv"))
    paths = tuple(os.path.join(glue_dir, "SST-2", name) for name in ("train.tsv", "dev.tsv"))
    return paths if all(os.path.isfile(p) for p in paths) else None


def check_shipped_budget(train_examples: int, min_words: int) -> None:
    """The shipped subset holds the default draw only: a budget that needs more of SST-2 must
    name GLUE's files (ValueError, before anything runs)."""
    if train_examples > SHIPPED_TRAIN_LINES or min_words < SHIPPED_MIN_WORDS:
        raise ValueError(
            f"the SST-2 subset shipped with bertforge holds {SHIPPED_TRAIN_LINES:,} train lines "
            f"of {SHIPPED_MIN_WORDS}+ words; --finetune-train-examples {train_examples} "
            f"--finetune-min-words {min_words} needs GLUE's whole SST-2: give --glue-dir "
            "(a folder holding SST-2/train.tsv and dev.tsv, from GLUE's download_glue_data.py)")


def finetune_sst2(model_dir: str, output: str, glue_dir: str | None,
                  budget: FinetuneBudget) -> dict[str, Any]:
    """The stage: both fine-tunes and the baseline, or {"skipped": why} without SST-2's files."""
    files = sst2_files(glue_dir)
    if files is None:
        reason = f"no SST-2 data ({glue_dir}/SST-2/train.tsv and dev.tsv); fine-tuning skipped"
        print(f"[demo] finetune: {reason}", flush=True)
        return {"skipped": reason}
    train, dev = files
    from bertforge.cluster.commands.finetune_sweep import run_finetunes
    from bertforge.cluster.launch.finetune_workers import finetune_launch
    from bertforge.cluster.launch.local_worker import runs_in_one_local_process

    configs = [_config(model_dir, os.path.join(output, name), train, dev, budget, random_init)
               for name, random_init in (("pretrained", False), ("random_init", True))]
    # Both in one worker: its start and DeepSpeed's set-up once, not twice. Fine-tuning's
    # local default: budget.workers workers sharing the machine's cores (one: no Ray).
    launch = finetune_launch({"workers": budget.workers})
    started = time.time()
    pretrained, random_init = run_finetunes(configs, launch)
    record = {
        "task": "sst2", "train": train, "dev": dev, "shipped": glue_dir is None,
        "train_examples_of": SHIPPED_DRAWN_FROM if glue_dir is None else _eligible(configs[0]),
        "train_lines": SST2_TRAIN_SENTENCES,
        # As summary.json reads back (a list, not the budget's tuple).
        "budget": {**budget.__dict__, "learning_rates": list(budget.learning_rates)},
        "pretrained": _outcome(pretrained), "random_init": _outcome(random_init),
        # The worker's start (once), both runs' data, training, dev scoring and exports.
        "finetune_seconds": round(time.time() - started, 1),
        "finetune_workers": ("one local worker process" if runs_in_one_local_process(launch)
                             else "one Ray Train worker group"),
        "bag_of_words": _bag_of_words(configs[0], budget.seed),
    }
    record["train_examples"] = record["pretrained"]["train_examples"]
    record["dev_examples"] = record["pretrained"]["dev_examples"]
    return record


def _config(model_dir: str, output: str, train: str, dev: str, budget: FinetuneBudget,
            random_init: bool) -> FinetuneConfig:
    rates = tuple(budget.learning_rates)
    # One rate is a run of its own; several, a sweep (finetune_sweep: the best is published).
    one_rate = {"learning_rate": rates[0]} if len(rates) == 1 else {
        "sweep": True, "sweep_learning_rates": rates}
    return FinetuneConfig(
        task="sst2", model=model_dir, output=output, train=train, dev=dev, **one_rate,
        seeds=(budget.seed,), epochs=budget.epochs,
        batch_size=budget.batch_size, max_seq_length=budget.max_seq_length,
        max_train_examples=budget.train_examples, max_dev_examples=budget.dev_examples,
        min_train_words=budget.min_words or None, random_init=random_init,
    )


def _eligible(cfg: FinetuneConfig) -> int:
    """How many train lines the subset was drawn from (those of min_words words or more)."""
    from bertforge.training.finetune.task_data import train_examples
    from bertforge.training.finetune.tasks import task_spec

    return len(train_examples(dataclasses.replace(cfg, max_train_examples=None),
                              task_spec("sst2")))


def _outcome(results: dict[str, Any]) -> dict[str, Any]:
    """The model's best run (accuracy, learning rate, whether it learned) and every rate's."""
    return {
        "accuracy": results["metrics"]["accuracy"],
        "learning_rate": results["best_run"]["learning_rate"],
        "accuracy_by_learning_rate": {f"{run['learning_rate']:g}": run["metrics"]["accuracy"]
                                      for run in results["sweep"]["runs"]},
        "steps": results["training"]["steps"],
        # The optimizer steps of every rate's run (the worker's start is shared:
        # finetune_seconds).
        "train_seconds": results["train_seconds"],
        "train_examples": results["data"]["num_train_examples"],
        "dev_examples": results["data"]["num_dev_examples"],
        "final_train_loss": results["training"]["final_train_loss"],
        "results": os.path.join(results["output"], "results.json"),
        "single_label": results.get("single_label"),
        "chance": results.get("chance"),
    }


def _bag_of_words(cfg: FinetuneConfig, seed: int) -> dict[str, Any]:
    from bertforge.cluster.demo.bow_baseline import bow_baseline
    from bertforge.training.finetune.glue_data import read_examples
    from bertforge.training.finetune.task_data import subsample, train_examples
    from bertforge.training.finetune.tasks import task_spec

    spec = task_spec("sst2")
    # The examples the fine-tunes drew (task_data: a fixed subset, whatever the run's seed).
    dev_examples = subsample(read_examples(cfg.dev, spec), cfg.max_dev_examples)
    result = bow_baseline(train_examples(cfg, spec), dev_examples, spec, seed=seed)
    print(f"[demo] finetune: bag-of-words baseline, accuracy {result['metrics']['accuracy']:.3f}"
          f" ({result['num_features']:,} n-grams, {result['seconds']:.1f} s)", flush=True)
    return {"accuracy": result["metrics"]["accuracy"], "seconds": result["seconds"],
            "num_features": result["num_features"], "train_examples": result["num_train"],
            "dev_examples": result["num_dev"]}


def summary_rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed summary's lines for this stage."""
    if "skipped" in record:
        return [("SST-2 fine-tuning", record["skipped"])]
    budget = record["budget"]
    lines = f"{record['train_examples']:,} of {record['train_examples_of']:,} train lines"
    if budget.get("min_words"):
        lines += f" of {budget['min_words']}+ words ({record['train_lines']:,} in all)"
    if record.get("shipped"):
        lines += ", the subset shipped with bertforge"
    rates = budget.get("learning_rates") or (budget["learning_rate"],)  # or recorded before
    rows = [("SST-2 fine-tuning budget",
             f"{lines}, {budget['epochs']:g} epochs ({record['pretrained']['steps']} steps of "
             f"{budget['batch_size']}), {budget['max_seq_length']} tokens, lr "
             f"{' and '.join(f'{rate:g}' for rate in rates)}"
             f"{' (each model at its best)' if len(rates) > 1 else ''}; dev "
             f"{record['dev_examples']}")]
    for key, label in (("pretrained", "from this pretraining"), ("random_init", "from random init"),
                       ("bag_of_words", "bag-of-words baseline")):
        run = record[key]
        seconds = run["train_seconds"] if "train_seconds" in run else run["seconds"]
        learned = ""
        if run.get("single_label") is not None:
            learned = f", {run['single_label']!r} for every sentence: nothing learned"
        rows.append((f"SST-2 dev accuracy, {label}",
                     f"{run['accuracy']:.3f}  ({_at_rates(run)}{seconds:.0f} s training"
                     f"{learned})"))
    chance = record["pretrained"].get("chance")
    if chance:  # a demo recorded before runs measured it has none
        rows.append(("SST-2 dev accuracy, always the commonest label",
                     f"{chance['metrics']['accuracy']:.3f}  ({chance['label']!r})"))
    if "finetune_seconds" in record:
        runs = "both runs" if len(rates) == 1 else f"all {2 * len(rates)} runs"
        rows.append(("SST-2 fine-tuning wall seconds",
                     f"{record['finetune_seconds']:.0f} ({runs}, "
                     f"{record.get('finetune_workers', 'one Ray Train worker group')})"))
    return rows


def _at_rates(run: dict[str, Any]) -> str:
    """`lr 0.001 (0.0003: 0.509), ` for a model fine-tuned at several rates, else nothing."""
    by_rate = run.get("accuracy_by_learning_rate") or {}
    if len(by_rate) < 2:
        return ""
    best = f"{run['learning_rate']:g}"
    others = ", ".join(f"{rate}: {accuracy:.3f}" for rate, accuracy in by_rate.items()
                       if rate != best)
    return f"lr {best}; {others}; "


def finetune_done(record: dict[str, Any] | None) -> bool:
    """Recorded and not skipped: a demo that found no SST-2 data tries again on its next run."""
    return record is not None and "skipped" not in record
