"""The typed training recipe. Recipes are plain functions returning a `TrainConfig`."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# "auto": bf16 where the device computes it natively, else fp32 (training.precision decides it
# when training starts, on the worker's device; the run's config.json records both).
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DECAYS = ("linear", "polynomial")
OPTIMIZERS = ("adamw", "lamb")


def _field(default: Any = None, help: str = "", **metadata: Any) -> Any:
    """A config field with its help text, which `bertforge train --help` shows as it is."""
    metadata["help"] = help
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Everything one training run needs; `bertforge train` flags and the pipeline file's phase
    overrides are generated from these fields (`bertforge.cluster.config_fields`)."""

    data_dir: str = _field(help="prepared shard directory")
    run_dir: str = _field(help="checkpoints, metrics and TensorBoard go here")
    # BertConfig fields except vocab_size, which always comes from the dataset's vocab.
    model: dict[str, Any] = _field({"preset": "tiny"}, help="BertConfig fields: a preset "
                                   "(tiny, mini, base, large) and any field to override")
    max_steps: int = _field(1000, "optimizer steps", aliases=("--steps",))
    micro_batch_size: int = _field(32, "sequences per worker per micro-step",
                                   aliases=("--batch-size",))
    # With global_batch_size set, accumulation is derived from it and the live world size
    # (so a resume on fewer workers keeps the same optimizer step); otherwise it is this.
    gradient_accumulation_steps: int = _field(1, "micro-steps per optimizer step "
                                              "(ignored when --global-batch-size is given)",
                                              aliases=("--grad-accum",))
    global_batch_size: int | None = _field(help="sequences per optimizer step; accumulation "
                                           "follows from the number of workers")
    learning_rate: float = _field(1e-4, "peak learning rate", aliases=("--lr",))
    warmup_steps: int | None = _field(help="linear warm-up steps (default: 10% of max_steps)")
    decay: str = _field("linear", "decay after warm-up", choices=DECAYS)
    decay_power: float = _field(1.0, "exponent of the polynomial decay")
    optimizer: str = _field("adamw", "lamb needs zero_stage 0 (see training.optim)",
                            choices=OPTIMIZERS)
    weight_decay: float = _field(0.01, "decoupled weight decay (not on biases and LayerNorm)")
    adam_betas: tuple[float, float] = _field((0.9, 0.999), "Adam's beta1 and beta2")
    adam_eps: float = _field(1e-6, "Adam's epsilon")
    gradient_clipping: float = _field(1.0, "global gradient-norm clip")
    # None: decided when training starts, from the live world size, the precision and the
    # device's memory (training.recipes.default_zero_stage); a resumed run keeps its own.
    zero_stage: int | None = _field(help="DeepSpeed ZeRO stage (default: decided at start: "
                                    "1 on several workers; on one, 0 in fp32 and 1 under bf16 "
                                    "(DeepSpeed's fp32-accumulating path); 2/3 only when the "
                                    "GPU's memory needs it)", choices=(0, 1, 2, 3))
    precision: str = _field("auto", "mixed precision of the engine; auto: bf16 on a GPU or CPU "
                            "with native bf16, else fp32", choices=PRECISIONS)
    activation_checkpointing: bool = _field(False, "recompute each encoder layer in backward")
    compile: bool = _field(False, "torch.compile the model inside the engine (in place: "
                           "state-dict names keep no _orig_mod. prefix)")
    seed: int = _field(12345, "model initialisation, masking and data order")
    mask_prob: float = _field(0.15, "share of tokens to predict")
    max_predictions: int | None = _field(help="masked positions per sequence (default: the "
                                         "dataset's, 20 at 128 tokens and 80 at 512)")
    whole_word_masking: bool = _field(False, "mask every piece of a chosen word")
    # Packing (training.data.packing): up to 3 instances a row, attention within each; the
    # micro-batch stays micro_batch_size instances (fewer rows), masked as unpacked.
    packing: bool = _field(False, "pack several instances a row (block-diagonal attention, "
                           "positions restarting per instance): almost no padding")
    log_every: int | None = _field(help="steps between log lines (default: max_steps/20, "
                                   "at most 50)")
    eval_every: int = _field(0, "steps between validation passes; 0: never during training")
    eval_batches: int = _field(50, "global batches per validation pass; 0: the whole split")
    # Dense peak TFLOP/s of one device, for MFU; None logs no MFU. E.g. 989 for an H100 SXM
    # in bf16, 312 for an A100 in bf16.
    peak_tflops: float | None = _field(help="per-device peak for MFU, e.g. 989 for an H100 "
                                       "in bf16")
    # Warm start of a fresh run: a checkpoint, a run directory (its newest checkpoint) or a
    # Hugging Face directory. Weights only: optimizer, schedule and data start anew.
    init_from: str | None = _field(help="warm-start weights: a checkpoint, a run directory or "
                                   "a Hugging Face directory")
    checkpoint_every: int = _field(0, "steps between checkpoints; 0: only at the end")
    keep_checkpoints: int = _field(2, "newest checkpoints kept")
    resume: bool = _field(True, "continue from the newest complete checkpoint in run_dir")
    dataloader_prefetch: int = _field(2, "batches prepared ahead by the loader thread")
    # Rows are validated as they are read either way (training.data.integrity).
    verify_checksums: bool = _field(True, "hash every shard against the manifest's sha256 "
                                    "once per process, beside training (a mismatch stops the "
                                    "run before its next checkpoint)")

    def __post_init__(self) -> None:
        if not self.data_dir or not self.run_dir:
            raise ValueError("data_dir and run_dir are required")
        self.adam_betas = tuple(self.adam_betas)
        if self.warmup_steps is None:
            self.warmup_steps = self.max_steps // 10
        if self.log_every is None:
            self.log_every = max(1, min(50, self.max_steps // 20))
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if self.zero_stage not in (None, 0, 1, 2, 3):
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
        if self.max_predictions is not None and self.max_predictions < 1:
            raise ValueError(f"max_predictions must be at least 1, got {self.max_predictions}")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1")
        self._check_optimizer()
        self._check_batch_and_eval()

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "lamb" and self.zero_stage not in (None, 0):  # None: 0 for LAMB
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

