"""The typed training recipe. Recipes are plain functions returning a `TrainConfig`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PRECISIONS = ("bf16", "fp16", "fp32")
DECAYS = ("linear", "polynomial")
OPTIMIZERS = ("adamw", "lamb")


@dataclass
class TrainConfig:
    data_dir: str
    run_dir: str
    # BertConfig fields except vocab_size, which always comes from the dataset's vocab.
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    max_steps: int = 1000
    micro_batch_size: int = 32  # per rank
    # With global_batch_size set, accumulation is derived from it and the live world size
    # (so a resume on fewer workers keeps the same optimizer step); otherwise it is this.
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None
    learning_rate: float = 1e-4
    warmup_steps: int = 100
    decay: str = "linear"
    decay_power: float = 1.0  # polynomial decay only
    optimizer: str = "adamw"  # "lamb": ZeRO stage 0 only (see training.optim)
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-6
    gradient_clipping: float = 1.0
    zero_stage: int = 2
    precision: str = "bf16"
    activation_checkpointing: bool = False  # recompute each encoder layer in backward
    seed: int = 12345
    mask_prob: float = 0.15
    max_predictions: int | None = None  # None: 20 at 128 tokens, 80 at 512 (Google's values)
    whole_word_masking: bool = False
    log_every: int = 10
    eval_every: int = 0  # steps between validation passes; 0: never during training
    eval_batches: int = 50  # cap per pass (global batches); 0: the whole validation split
    # Dense peak TFLOP/s of one device, for MFU; None logs no MFU. E.g. 989 for an H100 SXM
    # in bf16, 312 for an A100 in bf16.
    peak_tflops: float | None = None
    # Warm start of a fresh run: a checkpoint, a run directory (its newest checkpoint) or a
    # Hugging Face directory. Weights only: optimizer, schedule and data start anew.
    init_from: str | None = None
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    resume: bool = True  # continue from the newest complete checkpoint in run_dir if any
    dataloader_prefetch: int = 2

    def __post_init__(self) -> None:
        self.adam_betas = tuple(self.adam_betas)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps], got {self.warmup_steps}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1")
        self._check_optimizer()
        self._check_batch_and_eval()

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "lamb" and self.zero_stage != 0:
            # ZeRO >= 1 hands the optimizer flat partitions that cut across parameters, so
            # LAMB's per-layer trust ratio ||w|| / ||update|| would be computed over slices of
            # several layers: silently wrong. DeepSpeed's FusedLamb is CUDA-only besides.
            raise ValueError(
                f"optimizer 'lamb' needs zero_stage 0, got {self.zero_stage}: ZeRO partitions "
                "flatten parameters, which breaks LAMB's per-layer trust ratios; "
                "use 'adamw' with ZeRO"
            )

    def _check_batch_and_eval(self) -> None:
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {self.global_batch_size}")
        for name in ("eval_every", "eval_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops must be positive, got {self.peak_tflops}")

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on `world_size` ranks."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_pass = self.micro_batch_size * world_size
        if self.global_batch_size % per_pass:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size x world_size = {self.micro_batch_size} x {world_size} = "
                f"{per_pass}; change micro_batch_size or the number of workers"
            )
        return self.global_batch_size // per_pass

    def global_batch(self, world_size: int) -> int:
        """Sequences per optimizer step: micro x accumulation x world."""
        # e.g. 32 micro x 1 accumulation x 2 workers = 64 sequences per optimizer step
        return self.micro_batch_size * self.accumulation_steps(world_size) * world_size

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

