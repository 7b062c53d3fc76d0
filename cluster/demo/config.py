"""The demo's settings (`DemoConfig`): `bertforge demo` flags are generated from its fields."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from bertforge.cluster.demo.sst2 import FinetuneBudget, check_shipped_budget
from bertforge.pipelines.contract.config_fields import (
    RERUN_MAY_CHANGE,
    option,
    same_option,
    without_marked,
)
from bertforge.training.config import TrainConfig
from bertforge.training.engine_config import engine_option
from bertforge.training.recipes import DEMO_TRAINING

DEFAULT_DEMO_DIR = "bertforge-demo"


@dataclass
class DemoConfig:
    """The demo's settings; `bertforge demo` flags are generated from these fields."""

    output: str = option(DEFAULT_DEMO_DIR, "directory for every output of the demo",
                         marks=(RERUN_MAY_CHANGE,))
    corpus_mb: float = option(4.0, "megabytes of docstring prose to gather")
    vocab_size: int = option(8192, "WordPiece vocabulary size")
    max_seq_length: int = option(128, "tokens per instance")
    dupe_factor: int = option(2, "passes over each document in prepare")
    num_shards: int = option(4, "train shards")
    prepare_workers: int = option(2, "Beam worker processes")
    train_workers: int = option(2, "Ray Train workers")
    # The recipe's (training.recipes.DEMO_TRAINING): 450 steps x 32 sequences fit the install
    # and the demo in five minutes on 2 AVX2 cores (benchmarks/README.md: the demo).
    max_steps: int = option(DEMO_TRAINING["max_steps"], "training steps", aliases=("--steps",))
    micro_batch_size: int = option(DEMO_TRAINING["micro_batch_size"],
                                   "sequences per worker per step (x 2 workers = 32)")
    learning_rate: float = option(DEMO_TRAINING["learning_rate"], "peak learning rate")
    seed: int = same_option(TrainConfig, "seed")
    # auto: fp32 on a CPU without native bf16, where emulated bf16 is ~60x slower per matmul.
    precision: str = engine_option("precision")
    # After the export: SST-2 fine-tuned from this model and from random weights, same budget
    # (cluster/demo/sst2.py). Why these values: benchmarks/README.md, "Does the demo's
    # pretraining help?".
    finetune_train_examples: int = option(2000, "SST-2 train sentences for the fine-tuning "
                                           "comparison (a fixed subset of 67,349; 0 skips it)")
    # SST-2's train set is mostly short phrases (9 words on average): from those neither model
    # learned reliably.
    finetune_min_words: int = option(10, "SST-2 train lines of at least this many words only "
                                      "(before the subset; 0: every line)")
    finetune_dev_examples: int | None = option(None, "SST-2 dev sentences scored (default: "
                                                "all 872)")
    finetune_epochs: float = option(2.0, "fine-tuning epochs over those sentences")
    finetune_max_seq_length: int = option(48, "fine-tuning tokens per sentence")
    finetune_batch_size: int = option(16, "fine-tuning sentences per step")
    # Each model at each rate, its best dev score reported (the BERT paper's choice of rate):
    # at one rate, 3e-4, random init stayed at chance where 1e-3 took it past the pretrained
    # model (benchmarks/README.md), so one rate's comparison was the rate's, not the weights'.
    finetune_learning_rates: tuple[float, ...] = option(
        (3e-4, 1e-3), "fine-tuning peak learning rates: both models are fine-tuned at each, "
        "and each model's best dev accuracy is compared")
    # Where SST-2 is read from: the shipped subset is GLUE's own lines of the default draw.
    glue_dir: str | None = option(None, "GLUE data holding SST-2/train.tsv and dev.tsv "
                                  "(default: the 2,000-line SST-2 subset shipped with "
                                  "bertforge, enough for the default budget)",
                                  marks=(RERUN_MAY_CHANGE,))

    def __post_init__(self) -> None:
        if self.corpus_mb < 0.1:
            raise ValueError("the demo corpus needs at least 0.1 MB (100,000 bytes)")
        if self.max_steps < 10:
            raise ValueError("the demo needs at least 10 training steps")
        if self.glue_dir is None and self.finetune_train_examples:
            check_shipped_budget(self.finetune_train_examples, self.finetune_min_words)

    def settings(self) -> dict[str, Any]:
        """What must match for a second run to reuse the first one's stages."""
        return without_marked(asdict(self), DemoConfig, RERUN_MAY_CHANGE)

    def finetune_budget(self) -> FinetuneBudget:
        """The fine-tuning stage's budget, the same for both models."""
        return FinetuneBudget(
            train_examples=self.finetune_train_examples, min_words=self.finetune_min_words,
            dev_examples=self.finetune_dev_examples,
            epochs=self.finetune_epochs, max_seq_length=self.finetune_max_seq_length,
            batch_size=self.finetune_batch_size, learning_rates=self.finetune_learning_rates,
            # One worker on every core: two on one machine pay an all-reduce and ZeRO's wrapper
            # every step (1.55x the time on the demo's model:
            # benchmarks/finetune_vs_plain_loop.py).
            seed=self.seed, workers=1,
        )


class DemoPaths:
    """Where each stage of a demo in `root` writes."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.corpus = os.path.join(self.root, "corpus", "docstrings.jsonl")
        self.vocab_dir = os.path.join(self.root, "vocab")
        self.vocab = os.path.join(self.vocab_dir, "vocab.txt")
        self.shards = os.path.join(self.root, "shards")
        self.run = os.path.join(self.root, "run")
        self.hf = os.path.join(self.root, "hf")
        self.eval = os.path.join(self.root, "eval.json")
        self.summary = os.path.join(self.root, "summary.json")
        self.loss_curve = os.path.join(self.root, "loss_curve.png")
        self.finetune = os.path.join(self.root, "finetune")
