"""A run's data: the task's examples read, subsampled and encoded into model inputs.

The same on every worker and for every (learning rate, seed) of a sweep: subsets are drawn with
a fixed seed, and SQuAD's article split (when dev-v1.1.json is the only file) with another, so
runs differ in their training seed only and score the same dev examples.
"""

from __future__ import annotations

import filecmp
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bertforge.pipelines.contract.tokenization import load_tokenizer
from bertforge.training.finetune import tasks
from bertforge.training.finetune.config import FinetuneConfig
from bertforge.training.finetune.features import encode_examples
from bertforge.training.finetune.glue_data import Example, read_examples, read_label_set

SUBSET_SEED = 0  # max_train/dev_examples: the same subset whatever the training seed
SQUAD_SPLIT_SEED = 0


@dataclass
class TaskData:
    spec: tasks.TaskSpec | None  # None for SQuAD
    train: dict[str, torch.Tensor]  # model inputs + labels (SQuAD: start/end positions)
    dev: dict[str, Any]  # model inputs (+ labels); SQuAD: also example_index and offsets
    dev_examples: list  # glue_data.Example or squad.SquadExample, in dev order
    num_train_examples: int

    @property
    def num_train_rows(self) -> int:
        """Model input rows: the examples, or SQuAD's windows (a long context gives several)."""
        return int(self.train["input_ids"].shape[0])

    @property
    def num_labels(self) -> int | None:
        """The classifier's width (1: regression); None: a span model (SQuAD)."""
        return None if self.spec is None else self.spec.num_labels


def resolve_spec(cfg: FinetuneConfig) -> tasks.TaskSpec | None:
    """The GLUE task's spec, a custom one from the flags (labels read from --train when not
    given), or None for SQuAD."""
    if cfg.is_squad:
        return None
    if cfg.task != tasks.CUSTOM_TASK:
        return tasks.task_spec(cfg.task)
    labels = None
    if not cfg.regression:
        # read_label_set reads the columns and header of this provisional spec, not its labels.
        columns = tasks.custom_task(cfg.text_columns, cfg.label_column, labels=("0", "1"),
                                    has_header=cfg.has_header)
        labels = cfg.labels or read_label_set(cfg.train, columns)
    return tasks.custom_task(cfg.text_columns, cfg.label_column, labels=labels,
                             has_header=cfg.has_header)


def subsample(items: list, limit: int | None) -> list:
    """A fixed random subset of `limit` items in their original order (all of them without)."""
    if limit is None or limit >= len(items):
        return items
    keep = np.sort(np.random.default_rng(SUBSET_SEED).permutation(len(items))[:limit])
    return [items[i] for i in keep]


def train_examples(cfg: FinetuneConfig, spec: tasks.TaskSpec) -> list[Example]:
    """cfg.train's examples of at least cfg.min_train_words words, then cfg.max_train_examples
    of them (a fixed subset): what the workers train on and the driver checks."""
    examples = read_examples(cfg.train, spec)
    if cfg.min_train_words:
        examples = [e for e in examples if _words(e) >= cfg.min_train_words]
        if not examples:
            raise ValueError(f"{cfg.train}: no training example has {cfg.min_train_words} words "
                             "or more; lower --min-train-words")
    return subsample(examples, cfg.max_train_examples)


def _words(example: Example) -> int:
    return len(example.text_a.split()) + (len(example.text_b.split()) if example.text_b else 0)


def is_squad_split(cfg: FinetuneConfig) -> bool:
    """SQuAD with one file for both: its articles are split into train and dev."""
    return cfg.is_squad and same_file(cfg.train, cfg.dev)


def same_file(first: str, second: str) -> bool:
    """One file under two names (a link, a hard link, `dir/../file`), or two copies of it.
    (Comparing the names, a link to SQuAD's dev file as --train trained on the whole dev set
    and then scored it; so did a copy, such as shared/data's glue-sst2-dev.tsv beside
    glue/SST-2/dev.tsv, for a GLUE task.) Files of different sizes are not read."""
    try:
        return os.path.samefile(first, second) or filecmp.cmp(first, second, shallow=False)
    except OSError:  # one is missing: the names decide, its reader says it is missing
        return os.path.realpath(first) == os.path.realpath(second)


def load_task_data(cfg: FinetuneConfig, vocab_path: str, lower_case: bool) -> TaskData:
    """Read, subsample and encode train and dev for `cfg` (train/dev already resolved)."""
    if cfg.train is None or cfg.dev is None:
        raise ValueError("the train and dev files must be resolved before loading the data")
    tokenizer = load_tokenizer(vocab_path, lower_case)
    if cfg.is_squad:
        return _load_squad(cfg, tokenizer)
    spec = resolve_spec(cfg)
    train = train_examples(cfg, spec)
    dev_examples = subsample(read_examples(cfg.dev, spec), cfg.max_dev_examples)
    return TaskData(
        spec=spec,
        train=encode_examples(tokenizer, train, cfg.seq_length),
        dev=encode_examples(tokenizer, dev_examples, cfg.seq_length),
        dev_examples=dev_examples,
        num_train_examples=len(train),
    )


def read_squad_split(cfg: FinetuneConfig) -> tuple[list, list]:
    """(train, dev) SQuAD examples: two files, or one split by article; then subsampled."""
    from bertforge.training.finetune.squad import read_squad, split_squad

    if is_squad_split(cfg):
        train, dev = split_squad(read_squad(cfg.train), cfg.squad_dev_fraction, SQUAD_SPLIT_SEED)
    else:
        train, dev = read_squad(cfg.train), read_squad(cfg.dev)
    return subsample(train, cfg.max_train_examples), subsample(dev, cfg.max_dev_examples)


def _load_squad(cfg: FinetuneConfig, tokenizer) -> TaskData:
    from bertforge.training.finetune.squad import squad_features

    train_examples, dev_examples = read_squad_split(cfg)
    options = {"max_seq_length": cfg.seq_length, "doc_stride": cfg.doc_stride,
               "max_query_length": cfg.max_query_length}
    return TaskData(
        spec=None,
        train=squad_features(tokenizer, train_examples, training=True, **options),
        dev=squad_features(tokenizer, dev_examples, training=False, **options),
        dev_examples=dev_examples,
        num_train_examples=len(train_examples),
    )
