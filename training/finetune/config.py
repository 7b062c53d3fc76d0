"""The typed fine-tuning recipe; `bertforge finetune` flags are generated from these fields.

Defaults are the BERT paper's: AdamW, batch 32, 3 epochs, 10 % linear warm-up then linear decay
to zero, 128 tokens (384 with a 128 stride for SQuAD), lr 2e-5 ({2e-5, 3e-5, 5e-5} with --sweep).
Weight decay 0.01 and Adam's epsilon 1e-6 are Google's `AdamWeightDecay` ones.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields
from typing import Any

from bertforge.pipelines.contract.config_fields import (
    RERUN_MAY_CHANGE,
    check_choices,
    option,
    without_marked,
)
from bertforge.training.engine_config import engine_option
from bertforge.training.finetune.tasks import (
    CUSTOM_TASK,
    SQUAD_TASK,
    canonical_task_name,
    task_spec,
)

# A run's outputs in its directory (rank 0 writes them): its record, and its Hugging Face export.
RESULT_NAME = "result.json"
HF_DIR_NAME = "hf"
GLUE_MAX_SEQ_LENGTH = 128
SQUAD_MAX_SEQ_LENGTH = 384
# One task's own: the task, its data, the model and where the outputs go (`bertforge glue` sets
# these for each task), and the settings only one kind of task has (SQuAD's windows, a custom
# task's columns). The others are the fine-tuning recipe, which glue applies to every task.
PER_TASK = "per_task"
# Which (learning rate, seed) runs to make: each run is recorded on its own, so a rerun into the
# same output may add seeds or rates and reuses the runs it has.
SELECTS_RUNS = "selects_runs"


def squad_window(seq_length: int, max_query_length: int) -> int:
    """Context tokens a SQuAD window of `seq_length` holds at least, after a question of
    `max_query_length`: [CLS] question [SEP] context [SEP]."""
    return seq_length - max_query_length - 3


# The BERT paper's fine-tuning rates (--sweep), and its one rate without a sweep.
PAPER_SWEEP = (2e-5, 3e-5, 5e-5)
PAPER_RATE = 2e-5
# features.pair_tokenizer's least: [CLS] a [SEP] b [SEP], each text cut to one token or none.
MIN_SEQ_LENGTH = 4
# SQuAD's own options: refused on another task (`_check_squad_only`).
SQUAD_ONLY = ("doc_stride", "max_query_length", "max_answer_length", "squad_dev_fraction")


@dataclass
class FinetuneConfig:
    """One fine-tuning job: a task, a pretrained model, and one run per (learning rate, seed)."""

    # The task and its data (PER_TASK).
    task: str = option(help="sst2, cola, mrpc, rte, stsb (any spelling: SST-2), squad, or custom",
                       marks=(PER_TASK,))
    model: str = option(help="a bertforge checkpoint, a run directory (its newest checkpoint) or "
                        "a Hugging Face BERT directory", marks=(PER_TASK,))
    output: str = option(help="results.json, dev predictions and the fine-tuned model go here",
                         marks=(PER_TASK, RERUN_MAY_CHANGE))
    train: str | None = option(help="training file (default: the task's file under --data-root: "
                               "glue/<Task>/train.tsv; squad: an article split of "
                               "squad/dev-v1.1.json, the only SQuAD file there)",
                               marks=(PER_TASK,))
    dev: str | None = option(help="dev file, scored after training (default: the task's file "
                             "under --data-root; give both --train and --dev, or neither; "
                             "SQuAD given one file as both: split by article)",
                             marks=(PER_TASK,))
    data_root: str | None = option(help="the directory holding glue/ and squad/ (default: "
                                   "../shared/data from the working directory, else shared/data "
                                   "beside bertforge's checkout, where it exists)",
                                   marks=(PER_TASK,))
    text_columns: tuple[str, ...] = option((), "custom task: one or two text columns, header "
                                           "names or 0-based indices", marks=(PER_TASK,))
    label_column: str | None = option(help="custom task: the label column", marks=(PER_TASK,))
    labels: tuple[str, ...] = option((), "custom task: the label strings in id order (default: "
                                     "those found in the train file)", marks=(PER_TASK,))
    regression: bool = option(False, "custom task: the label is a score (Pearson/Spearman)",
                              marks=(PER_TASK,))
    has_header: bool = option(True, "custom task: the TSV's first line names the columns and is "
                              "not read as data (on by default; --no-has-header for a file "
                              "without one, e.g. GLUE's CoLA)", marks=(PER_TASK,))
    # Which runs to make (SELECTS_RUNS).
    learning_rate: float = option(PAPER_RATE, "peak learning rate (without --sweep)",
                                  aliases=("--lr",),
                                  marks=(SELECTS_RUNS,))
    seeds: tuple[int, ...] = option((12345,), "one run per seed (head init, dropout, order)",
                                    marks=(SELECTS_RUNS,))
    sweep: bool = option(False, "one run per learning rate in --sweep-learning-rates and seed; "
                         "reports the best dev score, the median and the spread",
                         marks=(SELECTS_RUNS,))
    sweep_learning_rates: tuple[float, ...] = option(PAPER_SWEEP, "the sweep's rates (with "
                                                     "--sweep)", marks=(SELECTS_RUNS,))
    # The recipe, and SQuAD's own settings (PER_TASK).
    epochs: float = option(3.0, "passes over the training examples")
    max_steps: int | None = option(help="stop after this many optimizer steps (default: epochs)")
    # SQuAD's rows are windows (a long context gives several), as in Google's run_squad.py.
    batch_size: int = option(32, "examples (squad: context windows) per optimizer step, over "
                             "all workers")
    eval_batch_size: int = option(64, "examples (squad: context windows) per forward pass per "
                                  "worker on dev")
    max_seq_length: int | None = option(help="tokens per example (default: 128; squad 384)")
    doc_stride: int = option(128, "squad: context tokens shared by consecutive windows",
                             marks=(PER_TASK,))
    max_query_length: int = option(64, "squad: question tokens kept", marks=(PER_TASK,))
    max_answer_length: int = option(30, "squad: longest answer span predicted, in tokens",
                                    marks=(PER_TASK,))
    squad_dev_fraction: float = option(0.2, "squad without --train: the articles held out as "
                                       "dev", marks=(PER_TASK,))
    warmup_fraction: float = option(0.1, "share of the steps warming the learning rate up")
    weight_decay: float = engine_option("weight_decay")
    adam_eps: float = engine_option("adam_eps")
    gradient_clipping: float = engine_option("gradient_clipping")
    max_train_examples: int | None = option(help="train on a fixed random subset of this many "
                                            "examples (the same for every seed)")
    max_dev_examples: int | None = option(help="score a fixed random subset of this many")
    # SST-2's train set is mostly phrases cut from its sentences (9 words on average; dev: 20,
    # whole sentences): a small subset of phrases teaches a small model little.
    min_train_words: int | None = option(help="train only on examples with at least this many "
                                         "words (the texts together), before any subset")
    random_init: bool = option(False, "the model's architecture and vocabulary with fresh "
                               "weights: what pretraining is worth")
    precision: str = engine_option("precision")
    # Not 3: dev is scored and the model exported from whole parameters (training.finetune.loop).
    zero_stage: int | None = engine_option("zero_stage", choices=(0, 1, 2))
    bf16_residual: bool | None = engine_option("bf16_residual")
    # How the run is shown and kept (RERUN_MAY_CHANGE).
    log_every: int | None = option(help="steps between progress lines (default: steps/20, at "
                                   "most 50)",
                                   marks=(RERUN_MAY_CHANGE,))
    keep_all_models: bool = option(False, "keep every sweep run's exported model, not only the "
                                   "best one's", marks=(RERUN_MAY_CHANGE,))

    def __post_init__(self) -> None:
        missing = [name for name in ("task", "model", "output") if not getattr(self, name)]
        if missing:
            raise ValueError(f"{', '.join('--' + name for name in missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} required")
        for name in ("text_columns", "labels", "seeds", "sweep_learning_rates"):
            setattr(self, name, tuple(getattr(self, name)))
        self.task = canonical_task_name(self.task)
        if self.task not in (SQUAD_TASK, CUSTOM_TASK):
            task_spec(self.task)  # a clear error listing the known tasks
        self._check_custom()
        self._check_squad_only()
        self._check_numbers()
        if self.task == SQUAD_TASK and self.min_train_words:
            raise ValueError("--min-train-words applies to GLUE-format tasks, not squad")

    def _check_custom(self) -> None:
        custom = (self.text_columns, self.label_column, self.labels, self.regression,
                  not self.has_header)
        if self.task != CUSTOM_TASK:
            if any(custom):
                raise ValueError("--text-columns, --label-column, --labels, --regression and "
                                 "--no-has-header are for --task custom")
            return
        if not self.text_columns or self.label_column is None:
            raise ValueError("--task custom needs --text-columns and --label-column")
        if self.train is None or self.dev is None:
            raise ValueError("--task custom needs --train and --dev")
        if self.regression and self.labels:
            raise ValueError("--regression takes no --labels")
        if self.label_column in self.text_columns:
            raise ValueError(f"--label-column {self.label_column} is also one of --text-columns "
                             f"{list(self.text_columns)}: the label is a column of its own")
        repeated = _first_repeated(self.text_columns)
        if repeated is not None:  # a sentence paired with itself
            raise ValueError(f"--text-columns names {repeated} twice: give one column, or two "
                             "different ones for a pair")

    def _check_squad_only(self) -> None:
        """SQuAD's own options on another task changed nothing but the output's settings, so a
        rerun without them was refused ("differs in: doc_stride")."""
        if self.is_squad:
            return
        defaults = {field.name: field.default for field in fields(self)}
        given = [name for name in SQUAD_ONLY if getattr(self, name) != defaults[name]]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"{flags} {'is' if len(given) == 1 else 'are'} for --task squad")

    def _check_numbers(self) -> None:
        if not self.seeds:
            raise ValueError("give at least one seed")
        # The rate the other mode takes was trained without a word of the one given.
        if self.sweep and self.learning_rate != PAPER_RATE:
            raise ValueError("--lr is the rate of a run without --sweep; give a sweep's rates "
                             "as --sweep-learning-rates")
        if not self.sweep and self.sweep_learning_rates != PAPER_SWEEP:
            raise ValueError("--sweep-learning-rates are --sweep's rates: add --sweep (or give "
                             "one rate as --lr)")
        rates = self.sweep_learning_rates if self.sweep else (self.learning_rate,)
        if not rates or min(rates) <= 0:
            raise ValueError(f"learning rates must be positive, got {list(rates)}")
        # One run per value, named by it (runs/lr<rate>-seed<seed>): a repeated one was the
        # same run again, counted twice in the median and spread over runs, as were two rates
        # alike to the 6 digits of a run's name (2e-5 and 2.0000001e-5).
        for flag, values in (("--seeds", self.seeds), ("--sweep-learning-rates", rates)):
            repeated = _first_repeated(f"{value:g}" for value in values)
            if repeated is not None:
                raise ValueError(f"{flag} lists {repeated} twice (to 6 digits, which name a "
                                 "run): each value is one run, and a repeat would count the "
                                 "same run twice in the median")
        positive = ("batch_size", "eval_batch_size", "doc_stride", "max_query_length",
                    "max_answer_length", "max_steps", "max_train_examples", "max_dev_examples",
                    "min_train_words", "max_seq_length", "log_every")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.epochs <= 0:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if not 0 < self.squad_dev_fraction < 1:
            raise ValueError(f"squad_dev_fraction must be in (0, 1), got {self.squad_dev_fraction}")
        if self.is_squad:
            self._check_squad_window()
        elif self.seq_length < MIN_SEQ_LENGTH:  # found by the worker before
            raise ValueError(f"max_seq_length must be at least {MIN_SEQ_LENGTH} (room for "
                             f"[CLS], [SEP] and the texts' tokens), not {self.seq_length}")
        check_choices(self)  # precision, zero_stage

    def _check_squad_window(self) -> None:
        """SQuAD's windows fit the length: found by the worker before (its directory then kept
        the refused settings), with no word of the flag to change."""
        window = squad_window(self.seq_length, self.max_query_length)
        if window < 2:  # no stride of at least 1 is shorter than the window
            raise ValueError(
                f"max_seq_length {self.seq_length} leaves {max(window, 0)} context tokens "
                f"after a {self.max_query_length}-token question: a window needs at least 2; "
                f"give a --max-seq-length of at least {self.max_query_length + 5} (or a "
                "shorter --max-query-length)")
        stride = self.doc_stride_for(self.seq_length)
        if stride != self.doc_stride:
            raise ValueError(
                f"max_seq_length {self.seq_length} leaves "
                f"{squad_window(self.seq_length, self.max_query_length)} "
                f"context tokens after a {self.max_query_length}-token question: more than "
                f"doc_stride {self.doc_stride} are needed; give --doc-stride {stride} (or a "
                "longer --max-seq-length, or a shorter --max-query-length)")

    def doc_stride_for(self, seq_length: int) -> int:
        """doc_stride, or half the window where the windows of `seq_length` are too short
        for it (a window must hold more than the stride)."""
        window = squad_window(seq_length, self.max_query_length)
        return self.doc_stride if window > self.doc_stride else max(1, window // 2)

    @property
    def is_squad(self) -> bool:
        return self.task == SQUAD_TASK

    @property
    def seq_length(self) -> int:
        """max_seq_length, or the task's default (128; 384 for SQuAD)."""
        if self.max_seq_length is not None:
            return self.max_seq_length
        return SQUAD_MAX_SEQ_LENGTH if self.is_squad else GLUE_MAX_SEQ_LENGTH

    def runs(self) -> list[tuple[float, int]]:
        """(learning rate, seed) of every run, learning rates outermost."""
        rates = self.sweep_learning_rates if self.sweep else (self.learning_rate,)
        return list(itertools.product(rates, self.seeds))

    def settings(self) -> dict[str, Any]:
        """What a rerun into the same output must match to reuse finished runs."""
        return without_marked(self.to_dict(), FinetuneConfig, RERUN_MAY_CHANGE, SELECTS_RUNS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FinetuneConfig:
        """The config `to_dict` gave (a worker's copy); an unknown key is a TypeError."""
        return cls(**data)


def _first_repeated(values) -> Any:
    """The first value `values` holds twice, or None."""
    seen = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None
