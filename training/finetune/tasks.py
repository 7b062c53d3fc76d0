"""What each downstream task is: its columns, label set, metrics and files.

GLUE's files (`download_glue_data.py` layout, `../shared/data/glue/<Task>/{train,dev}.tsv`) are read
as the table in `DOWNSTREAM-SOURCES.md` describes them: CoLA has no header, MRPC starts with a BOM,
RTE's labels are words, STS-B is a regression on a 0-5 score. Label ids are positions in `labels`,
in the order Hugging Face's `run_glue.py` uses, so a fine-tuned export's `id2label` agrees with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

Column = str | int  # a header name, or a 0-based field index (the only choice without a header)

# Metric names, the keys `metrics.task_metrics` returns.
ACCURACY, F1, MCC, PEARSON, SPEARMAN = "accuracy", "f1", "matthews_corrcoef", "pearson", "spearman"
METRIC_NAMES = (ACCURACY, F1, MCC, PEARSON, SPEARMAN)
SQUAD_TASK = "squad"  # not a TaskSpec: its data is JSON (see squad.py)
CUSTOM_TASK = "custom"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    text_columns: tuple[Column, ...]  # one (single sentence) or two (a pair: [CLS] A [SEP] B [SEP])
    label_column: Column
    labels: tuple[str, ...] | None  # the label strings, id = position; None = regression (STS-B)
    metrics: tuple[str, ...]
    primary_metric: str  # the one a sweep maximises
    has_header: bool
    train_file: str | None  # relative to the GLUE directory; None for a custom task
    dev_file: str | None
    # A regression's scores, lowest and highest (STS-B's 0-5); None: any finite number.
    score_range: tuple[float, float] | None = None
    # What each label means, where the file's labels are bare ids ("0", "1"): the export's
    # id2label, so that a `pipeline("text-classification")` of it says "positive", not "1"
    # (the names of GLUE's Hugging Face dataset). None: the labels say it themselves.
    label_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.text_columns) not in (1, 2):
            raise ValueError(
                f"task {self.name}: give one or two text columns, not {list(self.text_columns)}"
            )
        if self.labels is not None and len(self.labels) < 2:
            raise ValueError(f"task {self.name}: a classification needs at least two labels")
        if self.labels is not None and len(set(self.labels)) != len(self.labels):
            raise ValueError(f"task {self.name}: repeated labels in {list(self.labels)}")
        unknown = [m for m in self.metrics if m not in METRIC_NAMES]
        if unknown or self.primary_metric not in self.metrics:
            raise ValueError(
                f"task {self.name}: metrics {list(self.metrics)} / primary {self.primary_metric!r}"
                f" must be among {list(METRIC_NAMES)}"
            )
        if self.label_names is not None and len(self.label_names) != len(self.labels or ()):
            raise ValueError(f"task {self.name}: {len(self.label_names)} label names for "
                             f"labels {list(self.labels or ())}")
        for column in (*self.text_columns, self.label_column):
            if not self.has_header and not isinstance(column, int):
                raise ValueError(
                    f"task {self.name}: column {column!r} must be a 0-based index: no header"
                )

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def exported_labels(self) -> tuple[str, ...] | None:
        """The export's label of each id (None for a regression)."""
        return self.label_names or self.labels

    @property
    def num_labels(self) -> int:
        """Output width of the classifier head: 1 for a regression."""
        return 1 if self.labels is None else len(self.labels)


BINARY = ("0", "1")
GLUE_TASKS: dict[str, TaskSpec] = {
    "sst2": TaskSpec(
        "sst2", ("sentence",), "label", BINARY, (ACCURACY,), ACCURACY, True,
        "SST-2/train.tsv", "SST-2/dev.tsv", label_names=("negative", "positive"),
    ),
    # CoLA: source, label, the author's mark, sentence; no header.
    "cola": TaskSpec(
        "cola", (3,), 1, BINARY, (MCC, ACCURACY), MCC, False, "CoLA/train.tsv", "CoLA/dev.tsv",
        label_names=("unacceptable", "acceptable"),
    ),
    "mrpc": TaskSpec(
        "mrpc", ("#1 String", "#2 String"), "Quality", BINARY, (F1, ACCURACY), F1, True,
        "MRPC/train.tsv", "MRPC/dev.tsv", label_names=("not_equivalent", "equivalent"),
    ),
    "rte": TaskSpec(
        "rte", ("sentence1", "sentence2"), "label", ("entailment", "not_entailment"),
        (ACCURACY,), ACCURACY, True, "RTE/train.tsv", "RTE/dev.tsv",
    ),
    # The BERT paper reports Spearman for STS-B; GLUE's table shows Pearson/Spearman.
    "stsb": TaskSpec(
        "stsb", ("sentence1", "sentence2"), "score", None, (PEARSON, SPEARMAN), SPEARMAN, True,
        "STS-B/train.tsv", "STS-B/dev.tsv", score_range=(0.0, 5.0),
    ),
}  # fmt: skip


def canonical_task_name(name: str) -> str:
    """`SST-2`, `sst-2`, `sst_2` and `sst2` are one task."""
    return name.strip().lower().replace("-", "").replace("_", "")


def task_spec(name: str) -> TaskSpec:
    """The GLUE task called `name` (any usual spelling)."""
    key = canonical_task_name(name)
    if key not in GLUE_TASKS:
        raise ValueError(
            f"unknown task {name!r}: the GLUE tasks are {', '.join(GLUE_TASKS)}; "
            f"also '{SQUAD_TASK}' (SQuAD v1.1 JSON) and '{CUSTOM_TASK}' "
            "(any GLUE-format TSV, with --text-columns and --label-column)"
        )
    return GLUE_TASKS[key]


def parse_column(column: Column) -> Column:
    """A command-line column: digits are a 0-based index, anything else a header name."""
    if isinstance(column, int):
        return column
    text = column.strip()
    return int(text) if text.isdigit() else text


def custom_task(
    text_columns: tuple[Column, ...] | list[Column],
    label_column: Column,
    labels: tuple[str, ...] | list[str] | None = None,
    has_header: bool = True,
) -> TaskSpec:
    """Any GLUE-format TSV: a classification over `labels` (accuracy; F1 too when binary), or a
    regression (Pearson/Spearman) when `labels` is None. `glue_data.read_label_set` lists a
    file's labels when the user did not."""
    text_columns = tuple(parse_column(c) for c in text_columns)
    label_column = parse_column(label_column)
    if labels is None:
        metrics, primary = (PEARSON, SPEARMAN), SPEARMAN
    else:
        labels = tuple(str(label) for label in labels)
        metrics = (ACCURACY, F1) if len(labels) == 2 else (ACCURACY,)
        primary = ACCURACY
    return TaskSpec(
        CUSTOM_TASK, text_columns, label_column, labels, metrics, primary, has_header, None, None
    )


def glue_dir_files(glue_dir: str, spec: TaskSpec) -> tuple[str, str]:
    """(train.tsv, dev.tsv) of a GLUE task under `glue_dir` (`<glue_dir>/SST-2/train.tsv`, ...)."""
    if spec.train_file is None or spec.dev_file is None:
        raise ValueError(f"task {spec.name} has no files in a GLUE directory: give --train/--dev")
    paths = os.path.join(glue_dir, spec.train_file), os.path.join(glue_dir, spec.dev_file)
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (the GLUE data of task {spec.name})")
    return paths


def incomplete_glue_tasks(glue_dir: str) -> dict[str, str]:
    """{task: the file it lacks} of the GLUE tasks with one of their two files under
    `glue_dir` but not the other: left out of a run of every task, and said to be."""
    incomplete = {}
    for name, spec in GLUE_TASKS.items():
        present = [os.path.isfile(os.path.join(glue_dir, f))
                   for f in (spec.train_file, spec.dev_file)]
        if any(present) and not all(present):
            incomplete[name] = spec.dev_file if present[0] else spec.train_file
    return incomplete


def available_glue_tasks(glue_dir: str) -> list[str]:
    """The GLUE tasks whose train and dev files are both under `glue_dir`, in GLUE_TASKS order."""
    return [
        name
        for name, spec in GLUE_TASKS.items()
        if all(os.path.isfile(os.path.join(glue_dir, f)) for f in (spec.train_file, spec.dev_file))
    ]
