"""The engine's machine-dependent settings, decided once for this process's device and the live
world size.

`resolve_engine` turns an `EngineConfig` as a user or a recipe leaves it (precision "auto", the
ZeRO stage, compiling and the micro-batch unset) into a `ResolvedEngine`: a frozen record in
which every one of them is decided. `training.engine`'s builder and DeepSpeed config take
nothing else, so no setting reaches the engine undecided and none is decided twice, perhaps
differently. Pretraining (`training.loop`) and fine-tuning (`training.finetune.loop`) both
resolve here, once, before they print their recipe and write their config.

What decides each, where the config leaves it open (a resumed run's own choice first where its
checkpoint's state depends on it):
- precision "auto": the checkpoint's; else bf16 where the device computes it natively, else fp32
  (training.precision). fp16 named on a CPU that has none is refused here, before any engine;
- the ZeRO stage: the checkpoint's; else `recipes.default_zero_stage` for the world size, the
  decided precision and the GPU's memory;
- compiling: on where the model trains on a GPU, off on a CPU (there the eager fast paths of
  training.cpu_kernels serve, and a compile costs more than a short run gains; on a GPU the
  fused kernels are most of the step's gain, benchmarks/README.md);
- the micro-batch: `recipes.micro_batch_for_device` for the sequence length and the GPU's memory;
- the bf16 residual stream: the checkpoint's (off for one saved before it existed); else on
  wherever the engine trains under bf16 autocast (bf16 at ZeRO 0), where it halves the bytes of
  every memory-bound kernel on the stream and follows fp32 arithmetic as closely as the fp32
  stream does (benchmarks/README.md, "Issue 34"); asked for anywhere else it would change
  nothing, and is refused.

FP8 GEMMs are never decided, only asked for (`--fp8`); they are refused where the decided
precision or stage leaves no bf16 autocast (by EngineConfig, as the bf16 stream), and here where
the device has no FP8 matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from bertforge.training.engine_config import EngineConfig
from bertforge.training.fp8 import fp8_unsupported_reason
from bertforge.training.precision import AUTO, resolve_precision, slow_precision_warning
from bertforge.training.recipes import default_zero_stage, micro_batch_for_device

# The EngineConfig fields that resolve_engine decides (a job that keeps its own copy of them,
# as TrainConfig does for config.json, copies these back from the record).
DECIDED = ("precision", "zero_stage", "compile", "micro_batch_size", "bf16_residual")


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    """What the run asked for, what it runs in and why; recorded in config.json and checkpoints."""

    requested: str
    resolved: str
    reason: str
    warning: str | None  # bf16 on a CPU that emulates it: said once, by rank 0

    def to_dict(self) -> dict[str, str | None]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ResolvedEngine:
    """An engine's settings with nothing left to decide, for `world_size` ranks: what
    `training.engine.build_engine` and `deepspeed_config` take. Made by `resolve_engine`;
    built any other way it still refuses an undecided or inconsistent setting."""

    config: EngineConfig
    world_size: int
    precision: PrecisionChoice

    def __post_init__(self) -> None:
        undecided = [name for name in DECIDED if getattr(self.config, name) in (None, AUTO)]
        if undecided:
            raise ValueError(f"the engine's {', '.join(undecided)} undecided: "
                             "training.resolved_engine.resolve_engine decides them")
        if self.precision.resolved != self.config.precision:
            raise ValueError(f"precision {self.config.precision} in the config but "
                             f"{self.precision.resolved} in its choice")
        self.config.accumulation_steps(self.world_size)  # the batch arithmetic holds


def get_accelerator():
    """DeepSpeed's accelerator, imported where it is used: importing it logs "Setting
    accelerator to CPU" onto the console of whatever process does, and a driver that imports
    this module for `check_cpu_engine` needs none."""
    from deepspeed.accelerator import get_accelerator as deepspeeds

    return deepspeeds()


def resolve_engine(
    cfg: EngineConfig, world_size: int, *, saved: Mapping[str, Any] | None = None,
    num_parameters: int | None = None, max_seq_length: int | None = None,
) -> ResolvedEngine:
    """`cfg` decided for this process's device and `world_size` ranks (the module docstring
    says how). `saved`: a resumed checkpoint's metadata (its "precision", "zero_stage" and
    "bf16_residual");
    `num_parameters`: the model's, for the ZeRO default; `max_seq_length`: the data's, needed
    where the micro-batch is left to the device."""
    saved = saved or {}
    device_type = get_accelerator().device_name()
    precision, reason = resolve_precision(cfg.precision, device_type,
                                          saved=saved.get("precision"))
    check_precision_supported(precision)
    choice = PrecisionChoice(cfg.precision, precision, reason,
                             slow_precision_warning(precision, device_type))
    memory = device_memory_bytes()
    zero_stage = cfg.zero_stage
    if zero_stage is None:
        zero_stage = saved.get("zero_stage")  # its optimizer state is laid out for that stage
    if zero_stage is None:
        zero_stage = default_zero_stage(
            world_size=world_size, precision=precision, optimizer=cfg.optimizer,
            num_parameters=num_parameters, device_memory_bytes=memory)
    micro_batch_size = cfg.micro_batch_size
    if micro_batch_size is None:
        if max_seq_length is None:
            raise ValueError("micro_batch_size is left to the device, and nothing says the "
                             "sequence length to choose it for")
        micro_batch_size = micro_batch_for_device(
            max_seq_length, world_size=world_size, global_batch_size=cfg.global_batch_size,
            device_memory_bytes=memory)
    decided = dataclasses.replace(
        cfg, precision=precision, zero_stage=zero_stage, micro_batch_size=micro_batch_size,
        compile=cfg.compile if cfg.compile is not None else device_type == "cuda")
    bf16_residual = cfg.bf16_residual
    if bf16_residual is None and saved:
        # A resume keeps the stream its run trained with (numbers, not state, depend on it);
        # a checkpoint saved before the setting existed trained with the fp32 stream.
        bf16_residual = bool(saved.get("bf16_residual")) and bf16_autocast(decided)
    if bf16_residual is None:
        bf16_residual = bf16_autocast(decided)
    if cfg.fp8:
        check_fp8_device()
    return ResolvedEngine(dataclasses.replace(decided, bf16_residual=bf16_residual), world_size,
                          choice)


def bf16_autocast(cfg: EngineConfig) -> bool:
    """bf16 at ZeRO stage 0: fp32 weights, the forward under torch.autocast (at stages 1-3
    DeepSpeed's bf16 model). `cfg` is decided (a ResolvedEngine's, or on its way to one)."""
    return cfg.precision == "bf16" and cfg.zero_stage == 0


def check_fp8_device() -> None:
    """FP8 GEMMs asked for on a device without them fail in cuBLASLt at the first step; say
    so up front."""
    reason = fp8_unsupported_reason(torch.device(get_accelerator().current_device_name()))
    if reason:
        raise ValueError(f"fp8: {reason}; leave --fp8 out")


def check_cpu_engine(cfg: EngineConfig) -> None:
    """What `resolve_engine` refuses on a CPU worker, refused by a driver whose CPU is its
    workers' (a local run without --gpu) before Ray starts: fp16 where DeepSpeed's CPU
    accelerator has none, and fp8 or a bf16 residual where "auto" gives fp32 (a CPU without
    native bf16). Inside the workers each was a traceback, retried up to --max-failures times.
    A resumed run decides "auto" by its checkpoint: the workers check that one."""
    precision, reason = resolve_precision(cfg.precision, "cpu")
    check_precision_supported(precision)
    try:
        dataclasses.replace(cfg, precision=precision)
    except ValueError as error:
        if cfg.precision != AUTO:
            raise
        raise ValueError(f"{error} (precision auto is {precision} on this CPU: {reason}; give "
                         "--precision bf16 to run it emulated, slowly)") from None


def check_precision_supported(precision: str) -> None:
    """fp16 on the CPU fails inside deepspeed.initialize; say what to do instead, up front.

    DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels (AVX512-FP16 /
    AMX-FP16 CPUs); elsewhere it raises "Type fp16 is not supported on your device".
    """
    if precision != "fp16":
        return
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and not accelerator.is_fp16_supported():
        raise ValueError(
            "precision fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 on this "
            "machine; use --precision auto on a CPU (bf16 where it is native, else fp32)"
        )


def device_memory_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None  # a CPU run's memory is the machine's: no ZeRO escalation for it
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
