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
divides it. The BERT-large recipes leave the micro-batch to the device (`micro_batch_for_device`:
512 tokens per GiB of GPU memory, so 256 x 128 on an 80 GB H100 and 512 x 128 on an H200);
`--micro-batch-size` overrides it. Every keyword overrides a field, e.g.
`bert_base_phase1(d, r, max_steps=100)`.

ZeRO stage: the full-size recipes leave it to the hardware (`zero_stage=None`), decided when
training starts by `default_zero_stage` from the live world size, the precision and the GPU's
memory; `--zero-stage` (or `zero_stage=`) overrides it, and the stage used is recorded in the
run's config.json and each checkpoint's bertforge.json (a resumed run keeps it). BERT's model
states are small next to a GPU. BERT-large, 335M parameters, bf16 with AdamW:

    bf16 weights         335M x 2 B = 0.67 GB
    bf16 gradients       335M x 2 B = 0.67 GB
    fp32 master weights  335M x 4 B = 1.34 GB
    Adam moments m, v    335M x 8 B = 2.68 GB
                                      ------- 5.4 GB
    fp32 gradient accumulation buffer 1.34 GB (grad_accum_dtype fp32, see training.engine)
                                      ------- 6.7 GB per GPU unsharded: 8 % of an 80 GB GPU

So nothing needs sharding for memory; what matters is communication and the host. On any
number of GPUs the default is stage 0 while the model states fit (below), DeepSpeed's plain
path, under bf16 with fp32 weights and torch.autocast (training.engine): fp32 gradients
accumulate in fp32 by construction, and the optimizer step is torch's fused AdamW with a
multi-tensor clip (training.clipped_adamw), a few kernels where DeepSpeed's BF16 and ZeRO
optimizers launch ~1,200 a step for BERT-large (measured on an H200: benchmarks/README.md). The
model states then take 16 B a parameter (weights, gradients, m, v in fp32): 5.4 GB for
BERT-large, on each GPU.
- On several GPUs stage 0 reduces the fp32 gradients once per optimizer step, in the backward
  that ends the accumulation: the gradients live in ~100 MB buckets, each all-reduced as soon as
  the backward has filled it (training.gradient_buckets), while the layers below still compute.
  The stage 1 that was the default there before 2026-11-27 reduced the same fp32 bytes only
  after the backward (DeepSpeed's BF16_Optimizer), then normed, scaled and copied each tensor on
  its own and read the norm back to the host twice a step. Counted on 2 CPU ranks (gloo,
  BERT-large's 302 tensors at tiny's width, one whole step): 2,479 computing operations, no
  copy and 1 read to the host (the model's CPU-only padding check) at stage 0; 3,002 and 3 at
  stage 1 (benchmarks/README.md, "Issue 34"). Not timed on several GPUs: none are lent to this
  project.
- Stage 1, 2, then 3 only when the model states at the stage before would take more than half
  of the device's memory (the rest is for activations): never for BERT on a 16 GB or larger
  GPU.
"""

from __future__ import annotations

from typing import Any

from bertforge.training.config import TrainConfig

# Where every full-size recipe departs from TrainConfig's defaults: RoBERTa's beta2 for large
# batches, and the logging, checkpoint and validation cadence of a run of days. The rest is the
# default (linear decay, AdamW, precision "auto": bf16 where native, else fp32; the ZeRO stage
# decided at start by `default_zero_stage`), said once, in the config.
FULL_SIZE_SETTINGS: dict[str, Any] = dict(
    adam_betas=(0.9, 0.98), log_every=50, checkpoint_every=1000, keep_checkpoints=3,
    eval_every=2000, eval_batches=100,
)

# Share of the device's memory that model states (weights, gradients, optimizer) may take;
# the rest is for activations (BERT-large at 64 x 128 tokens in bf16: ~10 GB).
MODEL_STATE_MEMORY_SHARE = 0.5


def model_state_bytes(
    num_parameters: int, *, precision: str, zero_stage: int, world_size: int
) -> float:
    """Bytes of weights, gradients and AdamW state per rank (the table in the module docstring).

    `precision` is a resolved one (bf16, fp16 or fp32; training.precision resolves "auto").
    Per parameter: weights w (2 B in bf16/fp16, 4 in fp32 and in bf16 at stage 0, where the
    weights stay fp32 under torch.autocast), gradients g (2 or 4) and, under bf16 at stage >= 1,
    a 4 B fp32 accumulation buffer a; optimizer o = fp32 moments 8 B, plus a 4 B fp32 master copy
    for 2-byte weights. Stage 1 shards o, stage 2 also g + a, stage 3 also w.
    """
    low_precision = precision == "fp16" or (precision == "bf16" and zero_stage >= 1)
    w = g = 2 if low_precision else 4
    a = 4 if precision == "bf16" and zero_stage >= 1 else 0
    o = 8 + (4 if low_precision else 0)
    n = world_size
    per_parameter = {
        0: w + g + a + o,
        1: w + g + a + o / n,
        2: w + (g + a + o) / n,
        3: (w + g + a + o) / n,
    }[zero_stage]
    return num_parameters * per_parameter


def default_zero_stage(
    *, world_size: int, precision: str, optimizer: str = "adamw",
    num_parameters: int | None = None, device_memory_bytes: int | None = None,
) -> int:
    """The ZeRO stage for a run that does not name one (see the module docstring):

    - 0: the fast path (under bf16 fp32 weights and torch.autocast, training.engine), on one
      rank or several; LAMB always (ZeRO's flat partitions break its per-layer trust ratios;
      training.optim);
    - then, on several ranks, 1, 2 and 3 while the model states would exceed
      MODEL_STATE_MEMORY_SHARE of `device_memory_bytes` (unknown, e.g. on a CPU: no
      escalation; on one rank sharding saves nothing).
    """
    stage = 0
    if (optimizer == "lamb" or num_parameters is None or device_memory_bytes is None
            or world_size == 1):
        return stage
    budget = MODEL_STATE_MEMORY_SHARE * device_memory_bytes
    while stage < 3 and model_state_bytes(
        num_parameters, precision=precision, zero_stage=stage, world_size=world_size
    ) > budget:
        stage += 1
    return stage


# Tokens a micro-batch may hold per GiB of the device's memory (rounded down to a power of two
# in all). BERT-large at 256 x 128 = 32,768 tokens peaked at 32.4 GiB on an H200 (bf16,
# benchmarks/results/gpu_throughput_nvidia-h200_2026-11-26.json): 512 a GiB leaves about half
# of the memory free. An 80 GB H100 gets 32,768 (256 x 128, 64 x 512), a 141 GB H200 65,536,
# a 40 GB A100 16,384.
TOKENS_PER_GIB = 512
# Where the device's memory is unknown (a CPU: the machine's RAM is shared with everything
# else): the recipes' fixed values before the rule (64 x 128, 16 x 512).
CPU_TOKENS_PER_MICRO_BATCH = 8192


def micro_batch_for_device(
    max_seq_length: int, *, world_size: int, global_batch_size: int | None,
    device_memory_bytes: int | None,
) -> int:
    """The micro-batch of a run that does not name one: the largest power of two whose tokens
    (x `max_seq_length`) stay within the device's budget (TOKENS_PER_GIB), and that divides
    the per-worker share of `global_batch_size` (so accumulation stays whole).

    A larger micro-batch is fewer launches and optimizer-free micro-steps per sequence: on an
    H200 BERT-large's step at 64 x 128 kept the GPU busy 23 % of the time, at 256 x 128 62 %
    (issue 34's profile, before the fast path)."""
    if device_memory_bytes is None:
        budget = CPU_TOKENS_PER_MICRO_BATCH
    else:
        budget = _power_of_two_at_most(TOKENS_PER_GIB * device_memory_bytes // 2**30)
    micro = _power_of_two_at_most(max(1, budget // max_seq_length))
    if global_batch_size is not None:
        per_worker = max(1, global_batch_size // world_size)
        while micro > 1 and (micro > per_worker or global_batch_size % (micro * world_size)):
            micro //= 2
    return micro


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _recipe(data_dir: str, run_dir: str, values: dict[str, Any], overrides: dict[str, Any]):
    return TrainConfig(data_dir=data_dir, run_dir=run_dir,
                       **{**FULL_SIZE_SETTINGS, **_overridden(values, overrides)})


def _overridden(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The recipe's `values` with `overrides`. Two follow what was given: other steps without
    another warm-up keep the recipe's warm-up share (`bert_base_phase1(d, r, max_steps=100)`:
    5 of 100, as 3,000 of 56,250), where its fixed count would exceed the run; an accumulation
    without a global batch sets the batch (micro x accumulation x workers)."""
    merged = {**values, **overrides}
    if "gradient_accumulation_steps" in overrides and "global_batch_size" not in overrides:
        # Accumulation given: the global batch follows from it (a recipe's global batch would
        # derive the accumulation instead, and the flag would be ignored).
        merged["global_batch_size"] = None
    if "max_steps" in overrides and "warmup_steps" not in overrides:
        share = values["warmup_steps"] / values["max_steps"]
        merged["warmup_steps"] = round(share * overrides["max_steps"])
    return merged


def bert_large_phase1(data_dir: str, run_dir: str, **overrides: Any) -> TrainConfig:
    """BERT-large (340M) at 128 tokens: 4,096 seq/step, 56,250 steps, peak lr 6e-4.

    6e-4 sits between RoBERTa-large's 4e-4 (at 8k) and the academic-budget 1e-3 (at 4k); a
    post-LN 24-layer model diverges more easily than the 12-layer one. Warmup ~5 % of steps.
    """
    return _recipe(data_dir, run_dir, dict(
        model={"preset": "large"}, global_batch_size=4096, micro_batch_size=None,
        max_steps=56_250, warmup_steps=3_000, learning_rate=6e-4,
    ), overrides)


def bert_large_phase2(data_dir: str, run_dir: str, init_from: str, **overrides: Any) -> TrainConfig:
    """BERT-large at 512 tokens from phase 1's weights: 2,048 seq/step, 12,500 steps, lr 4e-4.

    A fresh warmup (10 %) because the optimizer state starts empty.
    """
    return _recipe(data_dir, run_dir, dict(
        model={"preset": "large"}, global_batch_size=2048, micro_batch_size=None,
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
    return TrainConfig(**_overridden(dict(
        data_dir=data_dir, run_dir=run_dir, model={"preset": "tiny"}, micro_batch_size=8,
        max_steps=20, warmup_steps=2, learning_rate=1e-3, zero_stage=0, log_every=5,
    ), overrides))


def bert_tiny_phase2(data_dir: str, run_dir: str, init_from: str, **overrides: Any) -> TrainConfig:
    return bert_tiny_phase1(data_dir, run_dir, **{"init_from": init_from, **overrides})


# The demo's training, where it departs from TrainConfig's defaults (`bertforge demo`'s
# --max-steps, --micro-batch-size and --learning-rate default to these): the default model, a
# 2-layer BERT, learns visibly in a few CPU minutes, a high learning rate suiting it. What was
# tried before these: benchmarks/README.md, "Does the demo's pretraining help?".
DEMO_TRAINING: dict[str, Any] = dict(
    max_steps=450, micro_batch_size=16, learning_rate=1e-3, zero_stage=2,
)


def demo_recipe(data_dir: str, run_dir: str, **overrides: Any) -> TrainConfig:
    """The demo's training; warm-up and logging follow the steps (10 % and 30 lines). Any field
    can be overridden (`bertforge train --recipe demo --resume never ...`)."""
    values = {**DEMO_TRAINING, **overrides}
    steps = values["max_steps"]
    return TrainConfig(data_dir=data_dir, run_dir=run_dir, **{
        "warmup_steps": max(1, steps // 10), "log_every": max(1, steps // 30), **values})


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
