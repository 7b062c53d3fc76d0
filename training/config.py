"""The typed training recipe. Recipes are plain functions returning a `TrainConfig`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from bertforge.pipelines.contract.config_fields import NO_FLAG, NOT_IN_FILE, option
from bertforge.training.engine_config import EngineConfig, engine_option

# The settings that follow max_steps unless given (a resume that gives another --max-steps
# derives them again: training.resume_settings).
DERIVED_FROM_MAX_STEPS = {
    "warmup_steps": lambda max_steps: max_steps // 10,
    "log_every": lambda max_steps: max(1, min(50, max_steps // 20)),
}


@dataclass
class TrainConfig:
    """Everything one training run needs; `bertforge train` flags and the pipeline file's phase
    overrides are generated from these fields (`bertforge.pipelines.contract.config_fields`). The
    engine's options are `EngineConfig`'s, offered here (`engine`)."""

    # `bertforge train` places these flags itself (--data, --run-dir: first and required) or
    # sets them from flags of its own (--preset, --resume auto|never); a pipeline file from its
    # own paths, always resuming.
    data_dir: str = option(help="prepared shard directory", flag="--data",
                           marks=(NO_FLAG, NOT_IN_FILE))
    run_dir: str = option(help="checkpoints, metrics and TensorBoard go here",
                          marks=(NO_FLAG, NOT_IN_FILE))
    # BertConfig fields except vocab_size, which always comes from the dataset's vocab.
    model: dict[str, Any] = option({"preset": "tiny"}, help="BertConfig fields: a preset "
                                   "(tiny, mini, base, large) and any field to override",
                                   marks=(NO_FLAG,))
    max_steps: int = option(1000, "optimizer steps", aliases=("--steps",))
    # None (the full-size recipes): decided at start for the device and the sequence length
    # (training.recipes.micro_batch_for_device).
    micro_batch_size: int | None = option(32, "sequences per worker per micro-step",
                                          aliases=("--batch-size",))
    # With global_batch_size set, accumulation is derived from it and the live world size
    # (so a resume on fewer workers keeps the same optimizer step); otherwise it is this.
    gradient_accumulation_steps: int = option(1, "micro-steps per optimizer step "
                                              "(ignored when --global-batch-size is given)",
                                              aliases=("--grad-accum",))
    global_batch_size: int | None = option(help="sequences per optimizer step; accumulation "
                                           "follows from the number of workers")
    learning_rate: float = option(1e-4, "peak learning rate", aliases=("--lr",))
    warmup_steps: int | None = option(help="linear warm-up steps (default: 10% of max_steps)")
    decay: str = engine_option("decay")
    decay_power: float = engine_option("decay_power")
    optimizer: str = engine_option("optimizer")
    weight_decay: float = engine_option("weight_decay")
    adam_betas: tuple[float, float] = engine_option("adam_betas")
    adam_eps: float = engine_option("adam_eps")
    gradient_clipping: float = engine_option("gradient_clipping")
    zero_stage: int | None = engine_option("zero_stage")
    precision: str = engine_option("precision")
    activation_checkpointing: bool = option(False, "recompute each encoder layer in backward")
    compile: bool | None = engine_option("compile")
    bf16_residual: bool | None = engine_option("bf16_residual")
    fp8: bool = engine_option("fp8")
    seed: int = option(12345, "model initialisation, masking and data order")
    mask_prob: float = option(0.15, "share of tokens to predict")
    max_predictions: int | None = option(help="masked positions per sequence (default: the "
                                         "dataset's, 20 at 128 tokens and 80 at 512)")
    whole_word_masking: bool = option(False, "mask every piece of a chosen word")
    # Packing (training.data.packing): up to 3 instances a row, attention within each; the
    # micro-batch stays micro_batch_size instances (fewer rows), masked as unpacked.
    packing: bool = option(False, "pack several instances a row (block-diagonal attention, "
                           "positions restarting per instance): almost no padding")
    log_every: int | None = option(help="steps between log lines (default: max_steps/20, "
                                   "at most 50)")
    eval_every: int = option(0, "steps between validation passes; 0: never during training")
    eval_batches: int = option(50, "global batches per validation pass; 0: the whole split "
                               "(its last, partial batch too, as `bertforge eval` scores it)")
    # Dense peak TFLOP/s of one device, for MFU; None logs no MFU. E.g. 989 for an H100 SXM
    # in bf16, 312 for an A100 in bf16.
    peak_tflops: float | None = option(help="per-device peak for MFU, e.g. 989 for an H100 "
                                       "in bf16")
    # Warm start of a fresh run: a checkpoint, a run directory (its newest checkpoint) or a
    # Hugging Face directory. Weights only: optimizer, schedule and data start anew.
    init_from: str | None = option(help="warm-start weights: a checkpoint, a run directory or "
                                   "a Hugging Face BERT directory (of any head: the "
                                   "pretraining heads it lacks start fresh)")
    checkpoint_every: int = option(0, "steps between checkpoints; 0: none by step count")
    # By time as well, so a run with no step cadence of its own (a plain `train`) does not lose
    # all its work to a failure hours in. Looked at on log lines: the ranks agree there.
    checkpoint_minutes: float = option(30.0, "also save once this many minutes have passed "
                                       "since the last save (looked at on log lines); 0: never "
                                       "by time")
    keep_checkpoints: int = option(2, "newest checkpoints kept")
    resume: bool = option(True, "continue from the newest complete checkpoint in run_dir",
                          marks=(NO_FLAG, NOT_IN_FILE))
    # training.profiling: a window of the loop itself, logging and checkpoints included. A
    # diagnostic of one `bertforge train` run: no key in a pipeline file's phases.
    profile_steps: tuple[int, int] | None = option(
        help="profile optimizer steps FIRST LAST (torch.profiler): host syncs a step, GPU "
             "busy, kernels a step, to RUN_DIR/profile/", marks=(NOT_IN_FILE,))
    dataloader_prefetch: int = option(2, "batches prepared ahead by the loader thread")
    # Rows are validated as they are read either way (training.data.integrity).
    verify_checksums: bool = option(True, "hash every shard against the manifest's sha256 "
                                    "once per process, beside training (a mismatch stops the "
                                    "run before its next checkpoint)")

    def __post_init__(self) -> None:
        if not self.data_dir or not self.run_dir:
            raise ValueError("data_dir and run_dir are required")
        self.adam_betas = tuple(self.adam_betas)
        # Not a field: what this config was left to derive (a checkpoint records them as
        # derived, so a resume with another --max-steps derives them again, while one given,
        # even the derived value, is kept). A config read back from a dict derives nothing.
        self.derived = tuple(name for name in DERIVED_FROM_MAX_STEPS if getattr(self, name) is None)
        for name in self.derived:
            setattr(self, name, DERIVED_FROM_MAX_STEPS[name](self.max_steps))
        self.engine()  # the engine's options and the batch arithmetic, checked there
        if self.log_every < 1:
            raise ValueError(f"log_every must be at least 1, got {self.log_every}")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.max_predictions is not None and self.max_predictions < 1:
            raise ValueError(f"max_predictions must be at least 1, got {self.max_predictions}")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1")
        for name in ("eval_every", "eval_batches", "checkpoint_every", "checkpoint_minutes"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.profile_steps is not None:
            self.profile_steps = tuple(self.profile_steps)
            first, last = self.profile_steps
            if not 1 <= first <= last:
                raise ValueError(f"profile_steps must be FIRST LAST with 1 <= FIRST <= LAST, "
                                 f"got {first} {last}")
            if last > self.max_steps:  # a window the run never reaches profiles nothing
                raise ValueError(f"profile_steps {first} {last} end after the run's last step, "
                                 f"{self.max_steps} (max_steps)")
        # The loader's own checks, here too: found in the worker, each was four tracebacks.
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.dataloader_prefetch < 0:
            raise ValueError(f"dataloader_prefetch must be >= 0, got {self.dataloader_prefetch}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}")

    def engine(self) -> EngineConfig:
        """This run's engine: its fields of the same names (every EngineConfig field is one)."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on `world_size` ranks."""
        return self.engine().accumulation_steps(world_size)

    def global_batch(self, world_size: int) -> int:
        """Sequences per optimizer step: micro x accumulation x world."""
        return self.engine().global_batch(world_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config keys: {unknown}")
        return cls(**data)

