"""What DeepSpeed's engine is built from (`training.engine.build_engine`), for pretraining and
fine-tuning alike.

The engine's options are declared here once: the optimizer and its schedule's shape, the
precision, the ZeRO stage, clipping, compiling, the residual stream's dtype, FP8 GEMMs.
`TrainConfig` offers every one of them as a flag and a pipeline-file key, `FinetuneConfig` the
ones fine-tuning lets a user set (the others keep their defaults here); both take the
declaration with `engine_option`, never restate it.

The run's schedule and batch (steps, learning rate, warm-up, micro-batch) have no option here:
each job derives them its own way (pretraining from its flags and recipe, fine-tuning from
epochs, the data and the number of workers), then builds one `EngineConfig` per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bertforge.pipelines.contract.config_fields import check_choices, option, same_option
from bertforge.training.errors import UserInputError

# "auto": bf16 where the device computes it natively, else fp32 (training.precision decides it
# when training starts, on the worker's device; the run's config.json records both).
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DECAYS = ("linear", "polynomial")
OPTIMIZERS = ("adamw", "lamb")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class EngineConfig:
    """One run's engine: its schedule and batch, and the engine's options."""

    max_steps: int  # optimizer steps
    learning_rate: float  # peak
    warmup_steps: int
    # Sequences per worker per micro-step; None: decided when training starts, from the
    # device's memory and the sequence length (training.recipes.micro_batch_for_device).
    micro_batch_size: int | None
    # With global_batch_size set, accumulation is derived from it and the live world size (so a
    # resume on fewer workers keeps the same optimizer step); otherwise it is this.
    gradient_accumulation_steps: int = 1
    global_batch_size: int | None = None

    decay: str = option("linear", "decay after warm-up", choices=DECAYS)
    decay_power: float = option(1.0, "exponent of the polynomial decay")
    optimizer: str = option("adamw", "lamb needs zero_stage 0 (see training.optim)",
                            choices=OPTIMIZERS)
    weight_decay: float = option(0.01, "decoupled weight decay (not on biases and LayerNorm)")
    adam_betas: tuple[float, float] = option((0.9, 0.999), "Adam's beta1 and beta2")
    adam_eps: float = option(1e-6, "Adam's epsilon")
    gradient_clipping: float = option(1.0, "global gradient-norm clip")
    # None: decided when training starts, from the live world size, the precision and the
    # device's memory (training.recipes.default_zero_stage); a resumed run keeps its own.
    zero_stage: int | None = option(help="DeepSpeed ZeRO stage (default: decided at start: "
                                    "0, or on several workers a higher one where the GPU's "
                                    "memory needs it)", choices=ZERO_STAGES)
    precision: str = option("auto", "mixed precision of the engine; auto: bf16 on a GPU or CPU "
                            "with native bf16, else fp32", choices=PRECISIONS)
    # None: decided at start, on where the model trains (training.resolved_engine).
    compile: bool | None = option(help="torch.compile each encoder layer (in place: "
                                  "state-dict names keep no _orig_mod. prefix; default: on a "
                                  "GPU, off on a CPU)")
    # None: decided at start, on where the engine trains under bf16 autocast
    # (training.resolved_engine); True elsewhere is refused, as it would change nothing.
    bf16_residual: bool | None = option(help="under bf16 autocast, hand the residual stream "
                                        "between layers on in bf16 (LayerNorm still "
                                        "normalises in fp32); default: on wherever bf16 runs "
                                        "under autocast (ZeRO 0)")
    # Opt-in: it changes the arithmetic of every encoder GEMM (training.fp8), where the
    # defaults keep the model's numerics; measured in benchmarks/README.md, "Issue 34".
    fp8: bool = option(False, "under bf16 autocast, multiply the encoder layers' forward and "
                       "input-gradient GEMMs in FP8 (e4m3, a scale per token each step; the "
                       "weight gradient stays bf16) on a GPU of compute capability 8.9+ (L4, "
                       "L40, H100, H200); a CPU runs them too, slower, for tests, in bf16 "
                       "(--precision bf16 where it has no native bf16)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "adam_betas", tuple(self.adam_betas))
        check_choices(self)  # precision, decay, optimizer, zero_stage
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps], got {self.warmup_steps}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {self.global_batch_size}")
        self._check_optimizer_values()
        self._check_optimizer()
        self._check_bf16_autocast_options()

    def _check_bf16_autocast_options(self) -> None:
        """bf16_residual and fp8 are refused where the precision or stage, named or decided
        (training.resolved_engine replaces them here), rules out bf16 autocast: on the driver
        for named ones."""
        named_elsewhere = (self.precision in ("fp16", "fp32")
                           or self.zero_stage not in (None, 0))
        stage = f" at ZeRO stage {self.zero_stage}" if self.zero_stage is not None else ""
        for name in ("bf16_residual", "fp8"):
            if getattr(self, name) and named_elsewhere:
                raise ValueError(
                    f"{name} needs the engine's bf16 autocast (bf16 at ZeRO stage 0), not "
                    f"precision {self.precision}{stage}: it would change nothing there; leave "
                    "it out, or train in bf16 at --zero-stage 0")

    def _check_optimizer_values(self) -> None:
        """Values the optimizers would refuse inside the workers, after Ray's start, once per
        retry (`Invalid beta parameter at index 0: 1.5`): refused here, in the driver."""
        if len(self.adam_betas) != 2 or not all(0 <= beta < 1 for beta in self.adam_betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got "
                             f"{' '.join(map(str, self.adam_betas))}")
        if not self.adam_eps > 0:  # 0: a weight whose gradient is 0 steps by 0/0, NaN
            raise ValueError(f"adam_eps must be positive, got {self.adam_eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0 (0: no clip), got "
                             f"{self.gradient_clipping}")
        if self.decay_power <= 0:
            raise ValueError(f"decay_power must be positive, got {self.decay_power}")

    def _check_optimizer(self) -> None:
        if self.optimizer == "lamb" and self.zero_stage not in (None, 0):  # None: 0 for LAMB
            # ZeRO >= 1 hands the optimizer flat partitions that cut across parameters, so
            # LAMB's per-layer trust ratio ||w|| / ||update|| would be computed over slices of
            # several layers: silently wrong. DeepSpeed's FusedLamb is CUDA-only besides.
            raise ValueError(
                f"optimizer 'lamb' needs zero_stage 0, got {self.zero_stage}: ZeRO partitions "
                "flatten parameters, which breaks LAMB's per-layer trust ratios; "
                "use 'adamw' with ZeRO"
            )

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on `world_size` ranks."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        assert self.micro_batch_size is not None, "decide micro_batch_size first (the loop does)"
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_pass = self.micro_batch_size * world_size
        if self.global_batch_size % per_pass:
            raise UserInputError(
                f"global_batch_size {self.global_batch_size} is not a multiple of "
                f"micro_batch_size x world_size = {self.micro_batch_size} x {world_size} = "
                f"{per_pass}; change micro_batch_size or the number of workers"
            )
        return self.global_batch_size // per_pass

    def global_batch(self, world_size: int) -> int:
        """Sequences per optimizer step: micro x accumulation x world."""
        # e.g. 32 micro x 1 accumulation x 2 workers = 64 sequences per optimizer step
        return self.micro_batch_size * self.accumulation_steps(world_size) * world_size


def engine_option(name: str, *, choices: tuple[Any, ...] | None = None) -> Any:
    """EngineConfig's declaration of the option `name` (default, help, choices), for a job's
    config that offers it; `choices` narrows what that job accepts."""
    return same_option(EngineConfig, name, choices=choices)
