"""The demo's settings (`DemoConfig`): `bertforge demo` flags are generated from its fields."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from bertforge.cluster.demo.sst2 import FinetuneBudget, check_shipped_budget
from bertforge.pipelines.contract.config_fields import RERUN_MAY_CHANGE, option, without_marked
from bertforge.training.engine_config import engine_option

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
    # 450 steps x 32 sequences of 128 tokens = ~0.65 epoch of the ~21,900 training pairs, in
    # fp32 on a CPU without native bf16: 0.24 s a step on 2 AVX2 cores, so that the install and
    # the demo together fit in five minutes there. Measured (2026-11-26): MLM accuracy 0.103
    # (baseline 0.063), NSP 0.634, SST-2 dev 0.626 against 0.509 from random init; 540 steps
    # (22 s more): 0.115, 0.629, 0.620. Earlier, before the vocabulary fix: 540 steps 0.120,
    # 0.632; 600 steps: 0.119-0.125, 0.623; 800: 0.132, 0.630. This model seems to need
    # updates more than sequences: 1,000 x 64 took ~330 s and left the unigram plateau later;
    # 1,000 x 16 reached MLM 0.124 but fine-tuned worse (SST-2 0.591), as did 800 x 32 of 64
    # tokens (0.557). 1e-3 beat 5e-4 (MLM 0.122 vs 0.102 after 600 steps) and 2e-3 (0.080
    # after 300).
    max_steps: int = option(450, "training steps", aliases=("--steps",))
    micro_batch_size: int = option(16, "sequences per worker per step (x 2 workers = 32)")
    learning_rate: float = option(1e-3, "peak learning rate")
    seed: int = option(12345, "data, masking and initialisation")
    # auto: fp32 on a CPU without native bf16, where emulated bf16 is ~60x slower per matmul.
    precision: str = engine_option("precision")
    # After the export: SST-2 fine-tuned from this model and from random weights, same budget
    # (cluster/demo/sst2.py). A subset of the train set keeps both within ~75 s.
    finetune_train_examples: int = option(2000, "SST-2 train sentences for the fine-tuning "
                                           "comparison (a fixed subset of 67,349; 0 skips it)")
    # SST-2's train set is mostly short phrases (9 words on average, dev sentences 20): from
    # 2,000 random phrases neither model learned reliably (0.51-0.65 over seeds, random init at
    # chance); from 2,000 of its 25,152 lines of 10 words or more the pretrained one did.
    finetune_min_words: int = option(10, "SST-2 train lines of at least this many words only "
                                      "(before the subset; 0: every line)")
    finetune_dev_examples: int | None = option(None, "SST-2 dev sentences scored (default: "
                                                "all 872)")
    finetune_epochs: float = option(2.0, "fine-tuning epochs over those sentences")
    # 48 cuts few dev sentences (20 words on average) and saved ~5 s over 64.
    finetune_max_seq_length: int = option(48, "fine-tuning tokens per sentence")
    # 16 (250 steps) learned where 32 (124 steps) often stayed at chance from either model.
    finetune_batch_size: int = option(16, "fine-tuning sentences per step")
    # 1e-4 underfit in 250 steps (train loss 0.67, dev 0.585 from the demo's model); 3e-4 suits a
    # 2-layer model (1e-3 stayed at chance), as 1e-3 does its pretraining.
    finetune_learning_rate: float = option(3e-4, "fine-tuning peak learning rate")
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
        """The fine-tuning stage's budget, the same for both fine-tunes."""
        return FinetuneBudget(
            train_examples=self.finetune_train_examples, min_words=self.finetune_min_words,
            dev_examples=self.finetune_dev_examples,
            epochs=self.finetune_epochs, max_seq_length=self.finetune_max_seq_length,
            batch_size=self.finetune_batch_size, learning_rate=self.finetune_learning_rate,
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
