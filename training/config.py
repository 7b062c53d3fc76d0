"""The typed training recipe. Recipes are plain functions returning a `TrainConfig`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PRECISIONS = ("bf16", "fp16", "fp32")
DECAYS = ("linear", "polynomial")


@dataclass
class TrainConfig:
    data_dir: str
    run_dir: str
    # BertConfig fields except vocab_size, which always comes from the dataset's vocab.
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    max_steps: int = 1000
    micro_batch_size: int = 32  # per rank
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    warmup_steps: int = 100
    decay: str = "linear"
    decay_power: float = 1.0  # polynomial decay only
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-6
    gradient_clipping: float = 1.0
    zero_stage: int = 2
    precision: str = "bf16"
    seed: int = 12345
    mask_prob: float = 0.15
    max_predictions: int | None = None  # None: 20 at 128 tokens, 80 at 512 (Google's values)
    whole_word_masking: bool = False
    log_every: int = 10
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

    def global_batch_size(self, world_size: int) -> int:
        # e.g. 32 micro x 1 accumulation x 2 workers = 64 sequences per optimizer step
        return self.micro_batch_size * self.gradient_accumulation_steps * world_size

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
