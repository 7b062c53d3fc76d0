"""Named training recipes: plain functions returning a `TrainConfig`.

The two-phase schedule of BERT (Devlin et al. 2019; NVIDIA DeepLearningExamples): phase 1 on
128-token data for ~90 % of the sequences, phase 2 on 512-token data warm-started from phase
1's weights (fresh optimizer, schedule and data position) so the position embeddings past 128
learn. The model keeps 512 positions in both phases.

Budget: Google trained 900k steps x 256 sequences at 128 tokens (230M sequences) and 100k x
256 at 512 (25.6M). NVIDIA reaches the same accuracy with LAMB at a global batch of 65,536;
LAMB does not combine with ZeRO (see training.optim), so these recipes use AdamW at the large
batches AdamW is known to handle (RoBERTa: 8k at lr 4e-4 to 1e-3; Izsak et al. 2021, "How to
Train BERT with an Academic Budget": 4k at lr 1e-3 to 2e-3), with RoBERTa's beta2 = 0.98 for
stability at large batch, and the same sequence budget as Google:

    phase 1: 4,096 seq/step x 56,250 steps = 230M sequences x 128 tokens
    phase 2: 2,048 seq/step x 12,500 steps = 25.6M sequences x 512 tokens

The global batch is fixed; accumulation follows from the live world size (e.g. 4,096 = 64 micro
x 8 accumulation x 8 GPUs), so the same recipe runs, and resumes, on any worker count that
divides it. Every keyword overrides a field, e.g. `bert_base_phase1(d, r, max_steps=100)`.
"""

from __future__ import annotations

from typing import Any

from bertforge.training.config import TrainConfig

# Shared by every full-size recipe: Google's masking and decay, bf16 and ZeRO-1 (optimizer
# state sharded; gradients need no sharding at these sizes).
_COMMON: dict[str, Any] = dict(
    decay="linear", weight_decay=0.01, adam_betas=(0.9, 0.98), adam_eps=1e-6,
    gradient_clipping=1.0, zero_stage=1, precision="bf16", optimizer="adamw",
    log_every=50, checkpoint_every=1000, keep_checkpoints=3, eval_every=2000, eval_batches=100,
)


def _recipe(data_dir: str, run_dir: str, values: dict[str, Any], overrides: dict[str, Any]):
    return TrainConfig(data_dir=data_dir, run_dir=run_dir, **{**_COMMON, **values, **overrides})


def bert_large_phase1(data_dir: str, run_dir: str, **overrides: Any) -> TrainConfig:
    """BERT-large (340M) at 128 tokens: 4,096 seq/step, 56,250 steps, peak lr 6e-4.

    6e-4 sits between RoBERTa-large's 4e-4 (at 8k) and the academic-budget 1e-3 (at 4k); a
    post-LN 24-layer model diverges more easily than the 12-layer one. Warmup ~5 % of steps.
    """
    return _recipe(data_dir, run_dir, dict(
        model={"preset": "large"}, global_batch_size=4096, micro_batch_size=64,
        max_steps=56_250, warmup_steps=3_000, learning_rate=6e-4,
    ), overrides)


def bert_large_phase2(data_dir: str, run_dir: str, init_from: str, **overrides: Any) -> TrainConfig:
    """BERT-large at 512 tokens from phase 1's weights: 2,048 seq/step, 12,500 steps, lr 4e-4.

    A fresh warmup (10 %) because the optimizer state starts empty; micro 16 at 512 tokens
    fits an 80 GB GPU in bf16 without activation checkpointing.
    """
    return _recipe(data_dir, run_dir, dict(
        model={"preset": "large"}, global_batch_size=2048, micro_batch_size=16,
        max_steps=12_500, warmup_steps=1_250, learning_rate=4e-4,
        init_from=init_from,
    ), overrides)


def bert_base_phase1(data_dir: str, run_dir: str, **overrides: Any) -> TrainConfig:
    """BERT-base (110M) at 128 tokens: 4,096 seq/step, 56,250 steps, lr 1e-3 (academic budget)."""
    return _recipe(data_dir, run_dir, dict(
        model={"preset": "base"}, global_batch_size=4096, micro_batch_size=128,
        max_steps=56_250, warmup_steps=3_000, learning_rate=1e-3,
    ), overrides)


def bert_base_phase2(data_dir: str, run_dir: str, init_from: str, **overrides: Any) -> TrainConfig:
    """BERT-base at 512 tokens from phase 1's weights: 2,048 seq/step, 12,500 steps, lr 5e-4."""
    return _recipe(data_dir, run_dir, dict(
        model={"preset": "base"}, global_batch_size=2048, micro_batch_size=32,
        max_steps=12_500, warmup_steps=1_250, learning_rate=5e-4,
        init_from=init_from,
    ), overrides)


def bert_tiny_phase1(data_dir: str, run_dir: str, **overrides: Any) -> TrainConfig:
    """Both phases in miniature (2 layers, 128 wide) for CPU tests and smoke runs."""
    return TrainConfig(**{**dict(
        data_dir=data_dir, run_dir=run_dir, model={"preset": "tiny"}, micro_batch_size=8,
        max_steps=20, warmup_steps=2, learning_rate=1e-3, zero_stage=0, precision="bf16",
        log_every=5,
    ), **overrides})


def bert_tiny_phase2(data_dir: str, run_dir: str, init_from: str, **overrides: Any) -> TrainConfig:
    return bert_tiny_phase1(data_dir, run_dir, **{"init_from": init_from, **overrides})


def demo_recipe(
    data_dir: str, run_dir: str, *, max_steps: int = 1000, micro_batch_size: int = 32,
    learning_rate: float = 1e-3, seed: int = 12345,
) -> TrainConfig:
    """Tiny BERT that learns visibly in a few CPU minutes: a high LR suits a 2-layer model."""
    return TrainConfig(
        data_dir=data_dir,
        run_dir=run_dir,
        model={"preset": "tiny"},
        max_steps=max_steps,
        micro_batch_size=micro_batch_size,
        learning_rate=learning_rate,
        seed=seed,
        warmup_steps=max(1, max_steps // 10),
        weight_decay=0.01,
        zero_stage=2,
        precision="bf16",
        log_every=max(1, max_steps // 30),
    )


# By name, for `bertforge train --recipe NAME` and pipeline files; phase 2 needs init_from.
RECIPES = {
    "bert_large_phase1": bert_large_phase1,
    "bert_large_phase2": bert_large_phase2,
    "bert_base_phase1": bert_base_phase1,
    "bert_base_phase2": bert_base_phase2,
    "bert_tiny_phase1": bert_tiny_phase1,
    "bert_tiny_phase2": bert_tiny_phase2,
    "demo": demo_recipe,
}


def recipe_by_name(
    name: str, data_dir: str, run_dir: str, *, init_from: str | None = None, **overrides: Any
) -> TrainConfig:
    """The named recipe with overrides; a clear error for unknown names or a missing init_from."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    if name.endswith("phase2"):
        if not init_from:
            raise ValueError(f"recipe {name} warm-starts from phase 1: give --init-from")
        return RECIPES[name](data_dir, run_dir, init_from, **overrides)
    if init_from:
        overrides["init_from"] = init_from
    return RECIPES[name](data_dir, run_dir, **overrides)
