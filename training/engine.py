"""DeepSpeed engine construction: the config is built in code from the run's resolved settings
(`training.resolved_engine.ResolvedEngine`: its `EngineConfig` with everything that depends on
the machine decided, and the world size; pretraining's and fine-tuning's alike)."""

from __future__ import annotations

import atexit
import os
import warnings
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from bertforge.training.clipped_adamw import ClippedAdamW
from bertforge.training.compile_cache import use_cache_per_cpu_level
from bertforge.training.engine_config import EngineConfig
from bertforge.training.gradient_buckets import GradientBuckets
from bertforge.training.model import BertEncoder, set_fp8, set_residual_in_autocast_dtype
from bertforge.training.optim import Lamb
from bertforge.training.ports import free_loopback_port
from bertforge.training.resolved_engine import ResolvedEngine, bf16_autocast
from bertforge.training.schedule import lr_multiplier


def _required(resolved: Any, caller: str) -> ResolvedEngine:
    """What reaches the engine is decided (training.resolved_engine), never a bare config."""
    if not isinstance(resolved, ResolvedEngine):
        raise TypeError(f"{caller} takes a ResolvedEngine (training.resolved_engine."
                        f"resolve_engine), got {type(resolved).__name__}")
    return resolved


def deepspeed_config(resolved: ResolvedEngine, *, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON config for this run, on its resolved settings' world size.

    `load_universal`: the resume loads a universal checkpoint (one saved under ZeRO >= 1 by
    another number of ranks, converted by training.checkpoint.convert_to_universal).
    """
    resolved = _required(resolved, "deepspeed_config")
    cfg, world_size = resolved.config, resolved.world_size
    stage = cfg.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    if world_size > 1 and stage in (1, 2):
        # Reduce gradient buckets on a side stream while the backward pass goes on (ZeRO-3
        # overlaps by default).
        zero["overlap_comm"] = True
    config: dict[str, Any] = {
        "train_batch_size": cfg.global_batch(world_size),
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.accumulation_steps(world_size),
        # On the fast path the optimizer clips (ClippedAdamW: multi-tensor kernels);
        # DeepSpeed's stage-0 clip takes one norm per tensor.
        "gradient_clipping": 0.0 if optimizer_clips(cfg) else cfg.gradient_clipping,
        "zero_optimization": zero,
        # We pass the optimizer ourselves: under ZeRO torch's own AdamW, a type ZeRO lists as
        # tested (LAMB runs at stage 0 only), so no "zero_allow_untested_optimizer": an
        # optimizer ZeRO does not know is DeepSpeed's error, not a warning on the console.
        "steps_per_print": 10**9,  # our own logging; DeepSpeed's would interleave with it
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device when a forward
        # starts and when a step ends, every micro-step from the third: the host then waits
        # for the GPU to drain twice a micro-step and queues nothing ahead. Our own metrics
        # read the device once a log line (training.loop._Window).
        "timers": {"throughput": {"enabled": False}},
    }
    if bf16_autocast(cfg):
        # fp32 weights, gradients and optimizer state, the model's forward under
        # torch.autocast: bf16 GEMMs, fp32 gradient accumulation by construction, and the
        # optimizer stays torch's fused one (DeepSpeed's "bf16" section would wrap it in
        # its BF16 optimizer, whose step is per tensor).
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
        # Sum the micro-batches' gradients in fp32: DeepSpeed's default is the model dtype,
        # and bf16's 8-bit mantissa drops small gradients from a sum of 64 micro-batches.
        # DeepSpeed 0.19 does this at stage 1 through its BF16_Optimizer, at 2 and 3 in the
        # ZeRO optimizers' fp32 partitions.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        # The sum over ranks is accumulation too: reduce the fp32 gradients as they are
        # (DeepSpeed's default rounds them to bf16 first). BERT-large: 1.34 GB per
        # optimizer step at stage 1, ~2 % of a 64 x 8-micro-step step on 8 H100s.
        config["communication_data_type"] = "fp32"
    elif cfg.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def optimizer_clips(cfg: EngineConfig) -> bool:
    """The fast path: at ZeRO stage 0 AdamW clips the gradients itself (ClippedAdamW). Under
    ZeRO >= 1 DeepSpeed's optimizer owns the fp32 gradients and clips them; LAMB keeps
    DeepSpeed's clip (its update is per tensor anyway)."""
    return cfg.zero_stage == 0 and cfg.optimizer == "adamw" and cfg.precision != "fp16"


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and LayerNorm weights (BERT's AdamWeightDecay rule)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        skip = name.endswith("bias") or "LayerNorm" in name
        (no_decay if skip else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def ensure_process_group() -> None:
    """Join the process group set up by the launcher, or make a 1-rank one for a plain process.

    Ray Train and `torchrun` initialise torch.distributed before we run; the `deepspeed`
    launcher sets RANK/WORLD_SIZE/MASTER_*; a plain `python` process sets nothing.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_loopback_port()),
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    skip_inference_shm_op()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    # DeepSpeed binds no device to a 1-rank NCCL group (DeepSpeed #8248), so torch 2.11 warns
    # at each barrier of its checkpoint save that it takes the current device, which is the
    # one this process trains on (seen on an H200 proof run's console): nothing to tell a user.
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"barrier\(\): using the device under current context")
    # The group this process made is this process's to end: NCCL otherwise warns at exit
    # ("destroy_process_group() was not called"), on the console of every GPU run.
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def skip_inference_shm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce op in every process.

    DeepSpeed's torch comm backend JIT-builds `deepspeed_shm_comm` (C++ with ninja) whenever it
    starts on a CPU: about a minute of both cores on a fresh 2-core machine, a rebuild whenever
    another ninja version sees the cached build, and a "built successfully" console line per
    process. Only `inference_all_reduce` (tensor-parallel inference) uses it; training's
    collectives go through torch.distributed. DeepSpeed keeps its op-compatibility table in one
    cached dict (`deepspeed.ops.__compatible_ops__`) that it reads before building, so marking
    the op incompatible there skips the build. On GPUs there is no such op (DeepSpeed's own
    check, mirrored here), and the table, whose first read probes every op, is not touched.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is None:
        return
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build_optimizer(model: torch.nn.Module, cfg: EngineConfig) -> torch.optim.Optimizer:
    """AdamW (any ZeRO stage; clipping itself at stage 0) or LAMB (stage 0; the config
    refuses it under ZeRO). `cfg` is a ResolvedEngine's."""
    groups = parameter_groups(model, cfg.weight_decay)
    hyper = {"lr": cfg.learning_rate, "betas": cfg.adam_betas, "eps": cfg.adam_eps}
    if cfg.optimizer == "lamb":
        return Lamb(groups, **hyper)
    if optimizer_clips(cfg):
        return ClippedAdamW(groups, max_grad_norm=cfg.gradient_clipping, **hyper)
    # DeepSpeed clips (ZeRO >= 1, or fp16 at stage 0): torch's own fused AdamW, whose exact
    # type ZeRO lists as tested (a subclass, ClippedAdamW with its clip off, drew DeepSpeed's
    # "untested optimizer" warning onto the console at ZeRO >= 1).
    return torch.optim.AdamW(groups, fused=True, **hyper)


def build_engine(model: torch.nn.Module, resolved: ResolvedEngine, *,
                 load_universal: bool = False):
    """Optimizer + warmup/decay schedule wrapped by DeepSpeed; returns the engine."""
    resolved = _required(resolved, "build_engine")
    cfg, world_size = resolved.config, resolved.world_size
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(f"the settings were resolved for {world_size} ranks, the process "
                         f"group has {dist.get_world_size()}")
    # Before anything compiles: the layers are traced with the stream's dtype and GEMMs.
    set_residual_in_autocast_dtype(model, cfg.bf16_residual)
    set_fp8(model, cfg.fp8)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_multiplier(
            step, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
            decay=cfg.decay, power=cfg.decay_power,
        ),
    )
    skip_inference_shm_op()  # deepspeed.initialize starts DeepSpeed's comm backend
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(resolved, load_universal=load_universal),
        dist_init_required=False,
    )
    if world_size == 1 and engine.zero_optimization_stage() == 0:
        # One rank has no gradients to reduce, yet DeepSpeed's stage-0 backward flattens every
        # gradient into buckets, all-reduces them with itself and copies them back, each step
        # (~0.4 s of a 3 s 4-layer BERT-base-wide step on 2 cores; fine-tuning's default is one
        # worker). The values are the same bit for bit: a sum of one tensor, divided by 1.
        engine.enable_backward_allreduce = False
    elif engine.zero_optimization_stage() == 0 and cfg.precision != "fp16":
        reduce_in_buckets(engine)
    if cfg.compile:
        use_cache_per_cpu_level()
        compile_model(engine, model, cfg)
    return engine


def reduce_in_buckets(engine) -> None:
    """Stage 0 on several ranks: the gradients are all-reduced bucket by bucket during the
    backward (training.gradient_buckets) instead of by DeepSpeed after it. fp16 keeps
    DeepSpeed's path: its FP16_Optimizer owns the gradients."""
    buckets = GradientBuckets(engine.module, engine.is_gradient_accumulation_boundary)
    engine.enable_backward_allreduce = False
    # DeepSpeed's stage-0 zero_grad (bf16 under autocast, fp32) sets each `.grad` to None in a
    # Python loop, which would end the views into the buckets: they zero themselves instead.
    engine.zero_grad = buckets.zero_grad
    engine.gradient_buckets = buckets


def compile_model(engine, model: torch.nn.Module, cfg: EngineConfig) -> None:
    """torch.compile in place (nn.Module.compile: parameter names, and so checkpoints and
    exports, never carry torch.compile's `_orig_mod.` prefix).

    Each encoder layer is compiled on its own, as torchtitan compiles its blocks: the 24
    layers of BERT-large share one graph (parameters are the graph's inputs), so a compile
    takes one layer's time, not 24 layers' (and the last layer, which runs on the heads' rows
    only, one more). Within a layer inductor fuses what eager runs as separate kernels:
    bias + GELU, dropout + residual + LayerNorm, the attention mask. Embeddings and heads stay
    eager: a few kernels a step. ZeRO-3 gathers each module's parameters from hooks that a
    compiled layer would trace: there DeepSpeed compiles the whole engine its own way.
    """
    options = inductor_options(engine.device)
    if cfg.zero_stage == 3 or not encoder_layers(model):
        engine.compile(compile_kwargs={"options": options} if options else {})
        return
    compile_encoder_layers(model, options)


def encoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer for module in model.modules() if isinstance(module, BertEncoder)
            for layer in module.layer]


def compile_encoder_layers(model: torch.nn.Module, options: dict[str, Any]) -> None:
    """Each encoder layer compiled in place with inductor's `options`, as `compile_model`
    does (and the benchmarks' experiments and diagnostics, with options of their own)."""
    for layer in encoder_layers(model):
        layer.compile(options=options or None)


def inductor_options(device: torch.device) -> dict[str, Any]:
    """Inductor's settings for the compiled layers (torch.compile's `options`; each compile
    its own, so nothing else in the process changes).

    On a GPU, `fallback_random`: dropout's masks come from ATen's own dropout kernel, as in
    eager mode, instead of one Philox draw an element inside inductor's fused residual +
    dropout + LayerNorm kernels (ATen's draws four numbers a call; the residual + LayerNorm
    kernel then reads its output, a pass more over memory that costs less than the draws).
    On an H200 at BERT-large 128 x 256 the step ran 1.016x and 1.018x as fast (two device
    calls, 2026-11-28; benchmarks/README.md), and the masks come from the kernel eager mode
    draws them with. On a CPU, unmeasured: inductor's defaults."""
    return {"fallback_random": True} if torch.device(device).type == "cuda" else {}
