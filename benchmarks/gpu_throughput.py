"""Training throughput and MFU of BERT on one GPU: our model in the real DeepSpeed engine,
beside the transformers peer on the same batches.

What runs is the training loop's own path: `training.model.BertForPreTraining` (the `large`
preset by default) wrapped by `training.engine.build_engine` (the DeepSpeed config builder,
optimizer and schedule the loop uses) from the `bert_large_phase1` recipe's settings (AdamW,
bf16) and the project's default engine settings (ZeRO stage 0 with fp32 weights under
torch.autocast and the residual stream in bf16, ClippedAdamW, compiled encoder layers;
`--zero-stage`, `--no-bf16-residual` and `--no-compile` give others), micro-batch size and
accumulation 1 overridden; each step is the loop's `engine(**batch)`, `engine.backward(loss)`,
`engine.step()` (an optimizer step every time).

The peer (`--peer`, on by default on a GPU): `benchmarks/gpu_peer_hf.py`, transformers'
`BertForPreTraining` as a user would train it (fp32 weights under bf16 autocast, torch's fused
AdamW, clipping), eager and under torch.compile, each in a fresh process after ours, on the same
lengths, micro-batches, batches and step counts; the table gives our sequences/s over each.

Batches: synthetic ones shaped like real pretraining data (`tests/support/synthetic.py`: Google's
length rule with short_seq_prob 0.1, the loader's masking, 15 % at most 20 predictions at 128
and 80 at 512, the loader's padding), or with `--data DIR` (repeatable) the first batches of a
prepared shard directory through `training.data.PretrainingLoader` (its max_seq_length is then
the sequence length). `--num-batches` distinct batches are built and moved to the device
before timing and cycled: data loading is left out (the loop's loader prefetches in a thread).

Timing: `--warmup` untimed steps, then `--steps` steps, each ended by a device synchronize.
FLOPs come from `training.flops.training_flops_per_batch` for the batches actually run:
- "needed" (TFLOP/s and MFU): each row at its real length (padding not counted), the MLM head
  at the labelled positions only and the last layer at [CLS] + the labelled positions (the
  work the model needs; the sparse-head savings are not counted as work done);
- "computed": what the model really computes: every padded position (the loop logs this one).
MFU = needed TFLOP/s over `--peak-tflops` per GPU (by default looked up from the GPU's name:
dense bf16 tensor-core peak). A bf16 matmul measured on the same device in the same run is
printed beside it as the reference for what the chip really reaches.

Results go to `--output-dir` (default benchmarks/results/) as JSON and markdown named by the
device and the date, e.g. gpu_throughput_nvidia-h100-80gb-hbm3_2026-11-21.json.

    python benchmarks/gpu_throughput.py                      # large, bf16, defaults, 128 and 512
    python benchmarks/gpu_throughput.py --seq-lens 128 --zero-stage 2 --no-compile --no-peer
    CUDA_VISIBLE_DEVICES= python benchmarks/gpu_throughput.py --device cpu --config tiny \\
        --seq-lens 128 --micro-batch 8 --steps 3 --warmup 1 --peak-tflops 1   # smoke test
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bertforge.training.data.collate import MaskingOptions
from bertforge.training.data.packing import DEFAULT_MAX_PER_ROW, packed_max_predictions
from bertforge.training.flops import mfu, training_flops_per_batch
from bertforge.training.host_gc import CollectionClock, FrozenSurvivors
from bertforge.training.masking import default_max_predictions
from bertforge.training.model import IGNORE_INDEX, PRESETS, BertConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `tests.support` (helpers shared with the tests, never installed) from this checkout; bertforge
# is the installed package (benchmarks/README.md).
sys.path.insert(0, REPO)

# Dense (no sparsity) bf16 tensor-core peak of one GPU, TFLOP/s, from NVIDIA's datasheets;
# the first name contained in torch.cuda.get_device_name() wins, so specific names go first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("H200", 989.0),
    ("A100", 312.0),
)
GIB = 2**30
PEER_SEED = 12345  # gpu_peer_hf.py builds its batches from this seed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(PRESETS), default="large", help="model preset")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="encoder layers (default: the preset's); fewer keep its width, "
                             "a quicker run (the peer builds whole presets: with --no-peer)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seq-lens", default="128,512", help="comma-separated (synthetic data)")
    parser.add_argument(
        "--micro-batch", default=None,
        help="one value, or one per sequence length (default: 32,768 tokens, 256 at 128, 64 at "
             "512; tests/support/synthetic.py)",
    )
    parser.add_argument("--steps", type=int, default=50, help="timed steps per sequence length")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--num-batches", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3),
                        help="default: the project's (training.recipes.default_zero_stage)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw",
                        help="lamb needs --zero-stage 0")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compiled encoder layers (default: the project's, on a GPU)")
    parser.add_argument("--bf16-residual", action=argparse.BooleanOptionalAction, default=None,
                        help="the residual stream between layers in bf16 under autocast "
                             "(LayerNorm normalises in fp32; training.model.LayerNorm); "
                             "default: the project's, on under bf16 autocast")
    parser.add_argument("--compile-mode",
                        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                        default="default",
                        help="experiment, not the product: torch.compile's mode for the "
                             "compiled layers; reduce-overhead replays each layer's kernels "
                             "as a CUDA graph (one launch, no gaps between its kernels); "
                             "max-autotune-no-cudagraphs tries Triton GEMMs, which can take "
                             "bias + GELU into their epilogue (minutes of autotuning)")
    parser.add_argument("--inductor-config", action="append", default=[], metavar="NAME=VALUE",
                        type=inductor_setting,
                        help="experiment, not the product (repeatable): one of "
                             "torch._inductor.config's settings for this run, VALUE a Python "
                             "literal, e.g. coordinate_descent_tuning=True (tunes each fused "
                             "kernel's launch settings), fallback_random=False (dropout's "
                             "masks drawn inside the fused kernels, not by ATen's kernel as "
                             "the engine has them on a GPU) or triton.enable_pdl=True (a "
                             "group's setting, dotted)")
    parser.add_argument("--attention", choices=("sdpa", "math"), default="sdpa",
                        help="experiment, not the product: math runs each attention as two "
                             "batched GEMMs around one fused mask + softmax + dropout kernel "
                             "(training.cpu_kernels.attention_by_matmuls) instead of SDPA's "
                             "fused kernels (cuDNN's on an H100/H200)")
    parser.add_argument("--dropout-mask", choices=("fused", "lanes"), default="fused",
                        help="experiment, not the product: lanes draws each hidden dropout's "
                             "mask as the CPU does (training.cpu_kernels.set_lane_masks: "
                             "ATen's 64-bit words, four 16-bit lanes each, in a kernel of "
                             "their own) instead of one random number an element inside "
                             "inductor's fused kernels")
    parser.add_argument("--packing", action="store_true",
                        help="several instances a row, as `bertforge train --packing` "
                             "(training.data.packing: up to 3, attention within each): "
                             "sequences/s and needed FLOPs count the instances, so padding "
                             "skipped is time saved; the peer runs them one a row")
    parser.add_argument("--fp8", action="store_true",
                        help="the opt-in FP8 GEMMs of the encoder layers (EngineConfig.fp8, "
                             "training.fp8): MFU stays counted against the bf16 peak")
    parser.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-dropout: a diagnostic, never a way to train: hidden and "
                             "attention dropout off, so the step's difference from the "
                             "defaults is what dropout costs (its masks' random numbers, drawn "
                             "inside the fused kernels and cuDNN's attention)")
    parser.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-gc-freeze: a diagnostic: the timed steps without the loop's "
                             "freeze of the objects alive after warm-up (training.host_gc), "
                             "so Python's full garbage collections may fall inside them")
    parser.add_argument("--gradient-buckets", action="store_true",
                        help="experiment: on one device, the gradient reduction several ranks "
                             "use at stage 0 (training.gradient_buckets: each bucket "
                             "all-reduced during the backward), here over this one rank: "
                             "its cost, and that it runs on the device's streams")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the transformers peer, eager and compiled (default: "
                             "on a GPU)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense peak TFLOP/s of one device (default: by GPU name)")
    parser.add_argument("--data", action="append", default=[],
                        help="a prepared shard directory (repeatable); its length replaces "
                             "--seq-lens")
    parser.add_argument("--short-seq-prob", type=float, default=0.1, help="synthetic lengths")
    parser.add_argument("--vocab-size", type=int, default=30522, help="synthetic data")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--output-dir", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--tag", default="", help="appended to the result file names")
    parser.add_argument("--commit", default=None, help="source commit (default: from git)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.num_batches < 1:
        parser.error("--steps and --num-batches must be >= 1, --warmup >= 0")
    return args


@dataclass
class Case:
    """One measurement: a sequence length, its micro-batch and where its batches come from."""

    seq_len: int
    micro_batch: int
    data_dir: str | None = None


_MISSING = object()


def inductor_setting(text: str) -> tuple[str, Any]:
    """`--inductor-config NAME=VALUE` as (NAME, VALUE): NAME one of torch._inductor.config's
    settings, dotted for a group's (`triton.enable_pdl`, as torch.compile's options name
    them), VALUE a Python literal."""
    import torch._inductor.config as inductor_config

    name, sep, value = text.partition("=")
    name = name.strip()
    setting = inductor_config
    for part in name.split("."):
        setting = getattr(setting, part, _MISSING) if sep and part else _MISSING
    if setting is _MISSING:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=VALUE with NAME one of torch._inductor.config's settings")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is no Python literal") from None


def plan_cases(args: argparse.Namespace) -> list[Case]:
    if args.data:
        from bertforge.training.dataset_facts import DatasetFacts

        lengths = [DatasetFacts.read(d).max_seq_length for d in args.data]
    else:
        lengths = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    from tests.support.synthetic import micro_batches

    micro = micro_batches(lengths, args.micro_batch)
    dirs = args.data or [None] * len(lengths)
    return [Case(n, b, d) for n, b, d in zip(lengths, micro, dirs, strict=True)]


def peak_tflops(args: argparse.Namespace, device_name: str) -> tuple[float, str]:
    """The peak for MFU and where it came from."""
    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak-tflops"
    if args.precision == "bf16":
        for name, tflops in PEAK_BF16_TFLOPS:
            if name.lower() in device_name.lower():
                return tflops, f"bf16 dense peak of {name} (datasheet)"
    raise SystemExit(
        f"no known {args.precision} peak for {device_name!r}: give --peak-tflops "
        "(the device's dense peak TFLOP/s)"
    )


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu (e.g. --config tiny)")
    if device == "cpu" and torch.cuda.is_available():
        # DeepSpeed and the process group would pick the GPU (nccl) anyway.
        raise SystemExit("--device cpu on a machine with CUDA: hide the GPUs with "
                         "CUDA_VISIBLE_DEVICES= first")


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()}"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(device: str, repeats: int = 10) -> dict[str, Any]:
    """A bf16 n x n x n matmul on random data (zeros run faster): what the chip really reaches."""
    n = 8192 if device == "cuda" else 512
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=generator)
            for _ in range(2))
    for _ in range(3):
        a @ b
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    seconds = (time.perf_counter() - started) / repeats
    return {"n": n, "dtype": "bf16", "tflops": 2 * n**3 / seconds / 1e12}


def batch_counts(
    batch: dict[str, torch.Tensor], model_config: BertConfig, max_predictions: int | None = None
) -> dict[str, int]:
    """Tokens and training FLOPs of one batch (see the module docstring for the two FLOPs);
    a packed batch's sequences are its instances, its needed FLOPs theirs.

    `max_predictions`: the model's (its last layer then runs the [CLS] position(s) + min(it,
    width) rows a row, training.model.output_rows); None: + the most labels in a row."""
    rows, width = batch["input_ids"].shape
    lengths, labelled = instance_counts(batch)
    labels_a_row = (batch["labels"] != IGNORE_INDEX).sum(dim=1)
    cls_a_row = batch["cls_positions"].shape[1] if "cls_positions" in batch else 1
    c = model_config
    shape = dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                 intermediate_size=c.intermediate_size, vocab_size=c.vocab_size)
    computed = training_flops_per_batch(
        **shape, batch_size=rows, seq_len=width, num_predictions=sum(labelled),
        # As the model runs it (training.model.output_rows).
        last_layer_rows=cls_a_row + (int(labels_a_row.max()) if max_predictions is None
                                     else min(max_predictions, width)),
    )
    needed = sum(
        training_flops_per_batch(**shape, batch_size=1, seq_len=int(length),
                                 num_predictions=int(n), last_layer_rows=1 + int(n))
        for length, n in zip(lengths, labelled, strict=True)
    )
    return {"sequences": len(lengths), "real_tokens": int(sum(lengths)),
            "padded_tokens": rows * width, "predictions": int(sum(labelled)),
            "flops_needed": needed, "flops_computed": computed}


def instance_counts(batch: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """Each instance's real tokens and labelled positions: one instance a row, or a packed
    row's instances (training.data.packing: positions restart at 0 where one begins)."""
    real = batch["attention_mask"].bool()
    labelled = batch["labels"] != IGNORE_INDEX
    if "position_ids" not in batch:
        return real.sum(dim=1).tolist(), labelled.sum(dim=1).tolist()
    starts = ((batch["position_ids"] == 0) & real).flatten()
    instance = starts.cumsum(0) - 1  # the instance each position belongs to
    count = int(starts.sum())
    lengths = torch.bincount(instance[real.flatten()], minlength=count)
    labels = torch.bincount(instance[labelled.flatten()], minlength=count)
    return lengths.tolist(), labels.tolist()


def make_batches(case: Case, args: argparse.Namespace, rank: int, world_size: int):
    """(batches on the CPU, vocab size, description of the data)."""
    from bertforge.training.data.packing import PackingOptions, pack_batch

    packing = PackingOptions() if args.packing else None
    packed = (f", packed up to {packing.max_per_row} instances a row (training.data.packing)"
              if packing else "")
    if case.data_dir is None:
        from tests.support.synthetic import synthetic_batches

        batches = synthetic_batches(
            args.num_batches, case.micro_batch, case.seq_len, args.vocab_size,
            seed=args.seed + rank, short_seq_prob=args.short_seq_prob,
        )
        if packing:  # as the loader packs a micro-batch (one a step: nothing to regroup)
            batches = [pack_batch(batch, pad_id=BertConfig.pad_token_id,
                                  row_length=case.seq_len, max_per_row=packing.max_per_row)
                       for batch in batches]
        return batches, args.vocab_size, (
            f"synthetic: Google length rule (short_seq_prob {args.short_seq_prob}), loader "
            f"masking (15 %, Google's max_predictions), loader padding{packed}"
        )
    from bertforge.training.data import PretrainingLoader

    loader = PretrainingLoader(case.data_dir, "train", batch_size=case.micro_batch,
                               seed=args.seed, rank=rank, world_size=world_size, prefetch=0,
                               packing=packing)
    batches = []
    while len(batches) < args.num_batches:  # across epochs if the split is small
        for batch in loader:
            batches.append(batch)
            if len(batches) == args.num_batches:
                break
        loader.set_epoch(loader.epoch + 1)
    return batches, loader.vocab_size, (f"shards: {case.data_dir} (train split, first "
                                        f"batches){packed}")


def train_config(args: argparse.Namespace, case: Case):
    from bertforge.training.recipes import bert_large_phase1

    # The recipe's optimizer and precision; one micro-batch per optimizer step.
    return bert_large_phase1(
        case.data_dir or "synthetic", os.path.join(args.output_dir, "unused-run-dir"),
        model=model_fields(args), micro_batch_size=case.micro_batch,
        global_batch_size=None, gradient_accumulation_steps=1, zero_stage=args.zero_stage,
        precision=args.precision, optimizer=args.optimizer, seed=args.seed,
        activation_checkpointing=args.activation_checkpointing, max_predictions=None,
        compile=args.compile, bf16_residual=args.bf16_residual, fp8=args.fp8,
    )


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The preset, with `--num-layers` in place of its own where given."""
    layers = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    return {"preset": args.config, **layers}


def measure(case: Case, args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    """Build model + engine, warm up, time `args.steps` steps; totals summed over ranks."""
    from bertforge.training.engine import (
        build_engine,
        deepspeed_config,
        inductor_options,
        reduce_in_buckets,
    )
    from bertforge.training.model import num_parameters
    from bertforge.training.resolved_engine import resolve_engine

    cfg = train_config(args, case)
    # What an earlier case left allocated (should be ~0: its engine is destroyed).
    memory_before = torch.cuda.memory_allocated() / GIB if args.device == "cuda" else None
    cpu_batches, vocab_size, data = make_batches(case, args, rank, world_size)
    model = build_model(args, case, vocab_size, cfg)
    counts = [batch_counts(b, model.config, model.max_predictions) for b in cpu_batches]
    parameters = num_parameters(model)
    try:
        resolved = resolve_engine(cfg.engine(), world_size)
    except ValueError as refused:  # e.g. a bf16 residual stream without bf16 autocast
        raise SystemExit(str(refused)) from None
    check_experiments(args, resolved)
    engine = build_engine(model, resolved)
    if args.gradient_buckets and world_size == 1:  # on several ranks the engine has them
        reduce_in_buckets(engine)
    recompile_layers(model, args, engine.device)
    skips_before = cudagraph_skips()
    batches = [{k: v.to(engine.device) for k, v in b.items()} for b in cpu_batches]
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, losses, collections = time_steps(engine, batches, args)
    totals = {key: sum(counts[i % len(counts)][key]
                       for i in range(args.warmup, args.warmup + args.steps))
              for key in counts[0]}
    result = {
        "seq_len": case.seq_len, "micro_batch": case.micro_batch, "data": data,
        "parameters": parameters, "deepspeed_config": deepspeed_config(resolved),
        "zero_stage": resolved.config.zero_stage, "compile": resolved.config.compile,
        "bf16_residual": resolved.config.bf16_residual,
        "fp8": resolved.config.fp8,
        "dropout": args.dropout,
        "attention": args.attention,
        "dropout_mask": args.dropout_mask,
        "packing": args.packing,
        "gc_freeze": args.gc_freeze,
        # The engine's own inductor settings (the product's), then the experiment's over them.
        "inductor_options": inductor_options(engine.device) if resolved.config.compile else {},
        "inductor_config": dict(args.inductor_config),
        "gradient_buckets": hasattr(engine, "gradient_buckets"),
        # Inductor leaves CUDA graphs out where it cannot use them (and says so only here):
        # a variant with skips did not measure what it is named after.
        "cudagraph_skips": cudagraph_skips() - skips_before,
        # Python's garbage collection inside the timed steps: full passes and all passes' time.
        "full_collections": len(collections.full_passes()),
        "collection_ms": 1e3 * sum(one.seconds for one in collections.passes),
        # What the full passes freed: their time spent on freeing, or on walking.
        "full_collections_freed": sum(one.collected for one in collections.full_passes()),
        "precision": resolved.config.precision,
        "step_ms_median": 1e3 * statistics.median(seconds), "step_ms_min": 1e3 * min(seconds),
        "step_ms_max": 1e3 * max(seconds),
        "loss_first": losses[0].item(), "loss_last": losses[-1].item(),
        "memory_before_gib": memory_before,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / GIB
                            if args.device == "cuda" else None),
        "peak_memory_reserved_gib": (torch.cuda.max_memory_reserved() / GIB
                                     if args.device == "cuda" else None),
        **reduce_over_ranks(totals, sum(seconds), engine.device),
    }
    engine.destroy()
    del engine, model, batches
    # The next length compiles afresh, static, as a run at that length would (not as a
    # recompilation with dynamic shapes).
    torch._dynamo.reset()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def build_model(args: argparse.Namespace, case: Case, vocab_size: int, cfg):
    """The model as the loop builds it for `case`, with this run's experiments and diagnostics
    set before anything compiles (gpu_profile.py builds its cases here too)."""
    from bertforge.training.cpu_kernels import set_lane_masks
    from bertforge.training.model import BertForPreTraining, set_math_attention

    model_config = BertConfig.preset(args.config, vocab_size=vocab_size)
    if args.num_layers is not None:
        model_config = dataclasses.replace(model_config, num_hidden_layers=args.num_layers)
    if not args.dropout:
        model_config = dataclasses.replace(model_config, hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0)
    torch.manual_seed(cfg.seed)
    model = BertForPreTraining(model_config)
    model.gradient_checkpointing = cfg.activation_checkpointing
    # The loader's bound on labels per row, as the loop sets it: a fixed-width sparse head.
    model.max_predictions = default_max_predictions(case.seq_len)
    if args.packing:
        model.max_predictions = packed_max_predictions(
            model.max_predictions, MaskingOptions.mask_prob, case.seq_len, DEFAULT_MAX_PER_ROW)
    set_math_attention(model, args.attention == "math")
    set_lane_masks(model, args.dropout_mask == "lanes")
    return model


def check_experiments(args: argparse.Namespace, resolved) -> None:
    """An experiment that would change nothing in this setting is refused, not timed (a bf16
    residual stream without bf16 autocast: by EngineConfig itself)."""
    if args.inductor_config and not resolved.config.compile:
        raise SystemExit("--inductor-config needs compiled layers (--compile, the default on "
                         "a GPU)")
    if args.compile_mode != "default" and not resolved.config.compile:
        raise SystemExit("--compile-mode needs compiled layers (--compile, the default on a GPU)")
    if args.num_layers is not None and peer_runs(args):
        raise SystemExit("--num-layers with the peer: it builds the preset's whole model "
                         "(--no-peer)")
    if not args.dropout and peer_runs(args):
        raise SystemExit("--no-dropout is a diagnostic beside the defaults, with --no-peer: "
                         "the peer trains with dropout")
    if args.gradient_buckets and (resolved.config.zero_stage != 0
                                  or resolved.config.precision == "fp16"):
        raise SystemExit("--gradient-buckets is stage 0's reduction (not fp16's): "
                         "--zero-stage 0 and bf16 or fp32")


def peer_runs(args: argparse.Namespace) -> bool:
    """Whether the transformers peer runs beside ours: `--peer`, by default on a GPU."""
    return args.peer if args.peer is not None else args.device == "cuda"


def cudagraph_skips() -> int:
    """How often inductor has left CUDA graphs out in this process, so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def recompile_layers(model: torch.nn.Module, args: argparse.Namespace,
                     device: torch.device) -> None:
    """Issue 34's experiments of this benchmark only (`--compile-mode`, `--inductor-config`;
    without them nothing to do): each encoder layer compiled with the mode's inductor settings
    and the given ones over the engine's own
    (training.engine.inductor_options; nothing has run yet, so this replaces the engine's
    compile before any). With "reduce-overhead" inductor records each layer's forward and
    backward as CUDA graphs (cudagraph trees), one replay per layer where the step now
    launches ~75 kernels a layer; with "max-autotune-no-cudagraphs" it times Triton GEMM
    templates against cuBLAS per shape and keeps the faster, fusing bias + GELU (11 ms of
    elementwise kernels a step at 256 x 128 on an H200) into a Triton GEMM's epilogue where it
    wins."""
    from torch._inductor import list_mode_options

    from bertforge.training.engine import compile_encoder_layers, inductor_options

    if args.compile_mode == "default" and not args.inductor_config:
        return
    compile_encoder_layers(model, {**inductor_options(device),
                                   **list_mode_options(args.compile_mode),
                                   **dict(args.inductor_config)})


def time_steps(engine, batches: list[dict[str, torch.Tensor]], args: argparse.Namespace):
    """Seconds of each timed step (synchronized), its loss, and the garbage collector's passes
    meanwhile (a CollectionClock); the loop's step, micro = step."""
    graphs = args.compile_mode == "reduce-overhead"

    def step(i: int) -> torch.Tensor:
        if graphs:  # a new iteration: the graphs' outputs of the last one may be reused
            torch.compiler.cudagraph_mark_step_begin()
        out = engine(**batches[i % len(batches)])
        engine.backward(out.loss)
        engine.step()
        return out.loss.detach()

    for i in range(args.warmup):
        step(i)
    synchronize(args.device)
    seconds, losses = [], []
    # As the loop, which freezes after its first step and again at each log line, and lets the
    # collector start no full pass of its own meanwhile (training/host_gc.py); the peer's steps
    # are timed so too.
    with FrozenSurvivors() as survivors:
        if args.gc_freeze:
            survivors.freeze()  # its own full collection comes before the clock's start
        with CollectionClock() as collections:
            for i in range(args.warmup, args.warmup + args.steps):
                started = time.perf_counter()
                losses.append(step(i))
                synchronize(args.device)
                seconds.append(time.perf_counter() - started)
    return seconds, losses, collections


def reduce_over_ranks(totals: dict[str, int], seconds: float, device) -> dict[str, Any]:
    """Counts summed over ranks; the time is the slowest rank's."""
    keys = sorted(totals)
    summed = torch.tensor([float(totals[k]) for k in keys], dtype=torch.float64, device=device)
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    out = dict(zip(keys, (int(v) for v in summed.tolist()), strict=True))
    out["timed_seconds"] = slowest.item()
    return out


def add_rates(result: dict[str, Any], peak: float, world_size: int) -> None:
    seconds = result["timed_seconds"]
    result["sequences_per_s"] = result["sequences"] / seconds
    result["real_tokens_per_s"] = result["real_tokens"] / seconds
    result["padded_tokens_per_s"] = result["padded_tokens"] / seconds
    for kind in ("needed", "computed"):
        tflops = result[f"flops_{kind}"] / seconds / 1e12  # all ranks together
        result[f"tflops_{kind}"] = tflops
        result[f"mfu_{kind}"] = mfu(tflops, peak_tflops_per_device=peak, world_size=world_size)
    result["gflop_needed_per_real_token"] = result["flops_needed"] / result["real_tokens"] / 1e9


def _num(x: float) -> str:
    """1,234 / 12.3 / 0.0123: three significant digits at least, also for a CPU's small rates."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table, readable as plain text."""
    header = ("| seq len | micro batch | step ms (median) | seq/s | real tok/s | padded tok/s "
              "| TFLOP/s needed | MFU | TFLOP/s computed | MFU computed | peak mem GiB |")
    lines = [header, "|" + "---:|" * header.count(" | ") + "---:|"]
    for r in results:
        memory = "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        lines.append(
            f"| {r['seq_len']} | {r['micro_batch']} | {r['step_ms_median']:.1f} "
            f"| {_num(r['sequences_per_s'])} | {_num(r['real_tokens_per_s'])} "
            f"| {_num(r['padded_tokens_per_s'])} | {_num(r['tflops_needed'])} "
            f"| {100 * r['mfu_needed']:.1f} % | {_num(r['tflops_computed'])} "
            f"| {100 * r['mfu_computed']:.1f} % | {memory} |"
        )
    return "\n".join(lines)


def source_commit(args: argparse.Namespace) -> str | None:
    if args.commit:
        return args.commit
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None  # e.g. a copied working tree without .git
    return head + (" (with uncommitted changes)" if dirty.strip() else "")


def environment(args: argparse.Namespace, name: str, world_size: int) -> dict[str, Any]:
    import deepspeed

    return {
        "device": name, "device_type": args.device, "world_size": world_size,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
        "python": platform.python_version(), "commit": source_commit(args),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
    }


def output_paths(output_dir: str, name: str, date: str, tag: str,
                 script: str = "gpu_throughput") -> tuple[str, str]:
    """<script>_<device>_<date>[_<tag>].{json,md}; never overwrites (suffix _2, _3 ...)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    stem = "_".join(p for p in (script, slug, date, tag) if p)
    os.makedirs(output_dir, exist_ok=True)
    candidate, n = stem, 1
    while any(os.path.exists(os.path.join(output_dir, candidate + ext))
              for ext in (".json", ".md")):
        n += 1
        candidate = f"{stem}_{n}"
    base = os.path.join(output_dir, candidate)
    return base + ".json", base + ".md"


def _inductor_config(result: dict[str, Any]) -> str:
    own = result.get("inductor_options") or {}
    settings = result.get("inductor_config") or {}
    return ("".join(f", inductor {name}={value!r}" for name, value in own.items()
                    if name not in settings)
            + "".join(f", inductor {name}={value!r} (experiment)"
                      for name, value in settings.items()))


def _layers(setup: dict[str, Any]) -> str:
    layers = setup.get("num_layers")
    return "" if layers is None else f" with {layers} encoder layer{'s' if layers > 1 else ''}"


def _compile_mode(setup: dict[str, Any]) -> str:
    mode = setup.get("compile_mode", "default")
    return "" if mode == "default" else f", compile mode {mode} (experiment)"


def markdown(report: dict[str, Any]) -> str:
    env, setup = report["environment"], report["setup"]
    reference = report["matmul_reference"]
    first = report["results"][0]
    autocast = "torch_autocast" in first["deepspeed_config"]
    return "\n".join([
        f"# BERT training throughput: {env['device']}, {env['date']}",
        "",
        f"- command: `{env['command']}`",
        f"- commit: {env['commit'] or 'unknown'}; torch {env['torch']}, CUDA {env['cuda']}, "
        f"DeepSpeed {env['deepspeed']}, Python {env['python']}; {env['world_size']} device(s)",
        f"- model: {setup['config']}{_layers(setup)} ({first['parameters']:,} parameters), "
        f"{first['precision']}, ZeRO-{first['zero_stage']}"
        f"{' (fp32 weights under torch.autocast)' if autocast else ''}, {setup['optimizer']}, "
        f"activation checkpointing {'on' if setup['activation_checkpointing'] else 'off'}, "
        f"compiled encoder layers {'on' if first['compile'] else 'off'}"
        f"{', bf16 residual stream' if first.get('bf16_residual') else ''}"
        f"{', FP8 GEMMs in the encoder layers' if first.get('fp8') else ''}"
        f"{'' if first.get('dropout', True) else ', dropout off (a diagnostic)'}"
        f"{', math attention (experiment)' if first.get('attention') == 'math' else ''}"
        f"{', lane dropout masks (experiment)' if first.get('dropout_mask') == 'lanes' else ''}"
        f"{'' if first.get('gc_freeze', True) else ', no gc freeze (a diagnostic)'}"
        f"{_inductor_config(first)}"
        f"{_compile_mode(setup)} "
        f"(settings given: "
        f"ZeRO {setup['zero_stage']}, compile {setup['compile']}, bf16 residual "
        f"{setup.get('bf16_residual')}; None = the project's default)"
        f"{'; MFU against the bf16 peak' if first.get('fp8') else ''}",
        f"- data: {first['data']}",
        f"- warm-up steps: {setup['warmup']}, then timed steps: {setup['steps']} per length; "
        f"{setup['num_batches']} distinct batches cycled, already on the device",
        f"- peak for MFU: {report['peak_tflops']:g} TFLOP/s per device "
        f"({report['peak_source']}); measured {reference['dtype']} matmul "
        f"{reference['n']}^3 on this device: {_num(reference['tflops'])} TFLOP/s",
        "",
        table(report["results"]),
        "",
        "TFLOP/s needed and MFU: each row at its real length (padding not counted), the MLM "
        "head and last layer at the labelled positions (+[CLS]) only. TFLOP/s computed: every "
        "padded position, as the model runs it. Both from training/flops.py.",
        "",
        *collections_line(report["results"]),
        *peer_section(report),
    ])


def collections_line(results: list[dict[str, Any]]) -> list[str]:
    """Python's garbage collection inside the timed steps, per length (the loop freezes the
    survivors of its first step so that no full pass falls there: training/host_gc.py)."""
    if not results or "full_collections" not in results[0]:
        return []
    each = "; ".join(f"{r['seq_len']}: {r['full_collections']} full"
                     f"{_freed(r)}, {r['collection_ms']:.1f} ms" for r in results)
    return [f"Python's garbage collection inside the timed steps (full passes, ms of all "
            f"passes): {each}.", ""]


def _freed(result: dict[str, Any]) -> str:
    if not result["full_collections"] or "full_collections_freed" not in result:
        return ""
    return f" (freeing {result['full_collections_freed']:,} objects)"


def peer_section(report: dict[str, Any]) -> list[str]:
    """The transformers peer's rows beside ours, and our sequences/s over each."""
    peers = report.get("peer") or []
    if not peers:
        return []
    lines = ["## Against transformers' BertForPreTraining on the same batches", "",
             "| seq len | micro batch | run | step ms (median) | seq/s | ours / this | "
             "peak mem GiB | warm-up s |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for ours in report["results"]:
        lines.append(f"| {ours['seq_len']} | {ours['micro_batch']} | bertforge (this run) "
                     f"| {ours['step_ms_median']:.1f} | {_num(ours['sequences_per_s'])} | 1.00 "
                     f"| {_memory(ours['peak_memory_gib'])} | |")
        for peer in peers:
            if (peer["seq_len"], peer["micro_batch"]) != (ours["seq_len"], ours["micro_batch"]):
                continue
            run = "transformers + torch.compile" if peer["compile"] else "transformers, eager"
            ratio = ours["sequences_per_s"] / peer["sequences_per_s"]
            lines.append(f"| {peer['seq_len']} | {peer['micro_batch']} | {run} "
                         f"| {peer['step_ms_median']:.1f} | {_num(peer['sequences_per_s'])} "
                         f"| **{ratio:.2f}** | {_memory(peer.get('peak_memory_gib'))} "
                         f"| {peer.get('warmup_s', 0):.0f} |")
    lines += ["", "The peer: benchmarks/gpu_peer_hf.py (fp32 weights under bf16 autocast, "
              "fused AdamW, clipping at 1.0, a dense MLM head), each run in a fresh process "
              "after ours, its timed steps with the garbage collector's survivors frozen as "
              "ours are.", ""]
    return lines


def _memory(gib: float | None) -> str:
    return "n/a" if gib is None else f"{gib:.1f}"


def run_peers(args: argparse.Namespace, cases: list[Case],
              report: dict[str, Any]) -> list[dict[str, Any]]:
    """gpu_peer_hf.py, compiled then eager for each of our cases, each in a fresh process
    (its memory and compiled graphs gone with it; the peer is one process on one device), at
    our micro-batch and step counts. The report is rewritten after each, so a time limit
    that stops one keeps the others. Synthetic data only: the peer builds the same batches
    from the same seed."""
    if any(case.data_dir for case in cases) or args.seed != PEER_SEED:
        print("[gpu_throughput] no peer rows: the peer runs on the default synthetic batches "
              "only", flush=True)
        return []
    results = report.setdefault("peer", [])
    for case in cases:
        for compiled in (True, False):
            out = os.path.join(args.output_dir, f".peer-{os.getpid()}.json")
            command = [sys.executable, os.path.join(REPO, "benchmarks", "gpu_peer_hf.py"),
                       "--device", args.device, "--config", args.config,
                       "--seq-lens", str(case.seq_len), "--micro-batch", str(case.micro_batch),
                       "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--num-batches", str(args.num_batches), "--out", out]
            if compiled:
                command.append("--compile")
            print(f"[gpu_throughput] peer: {shlex.join(command[1:])}", flush=True)
            finished = subprocess.run(command, check=False)
            if finished.returncode != 0:
                print(f"[gpu_throughput] WARNING: the peer exited {finished.returncode}",
                      flush=True)
                continue
            with open(out, encoding="utf-8") as f:
                results += json.load(f)
            os.remove(out)
            write_report(report)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    check_device(args.device)
    from bertforge.training.engine import ensure_process_group

    ensure_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    name = device_name(args.device)
    peak, peak_source = peak_tflops(args, name)
    cases = plan_cases(args)
    reference = matmul_tflops(args.device)
    results = []
    for case in cases:
        result = measure(case, args, rank, world_size)
        add_rates(result, peak, world_size)
        results.append(result)
        if rank == 0 and not math.isfinite(result["loss_last"]):
            print(f"[gpu_throughput] WARNING: loss {result['loss_last']} at seq {case.seq_len}")
        if rank == 0:
            print(f"[gpu_throughput] seq {case.seq_len} x {case.micro_batch}: "
                  f"{result['step_ms_median']:.1f} ms/step, MFU {100 * result['mfu_needed']:.1f} %",
                  flush=True)
    report = {
        "environment": environment(args, name, world_size),
        "setup": {key: getattr(args, key) for key in (
            "config", "num_layers", "precision", "zero_stage", "optimizer",
            "activation_checkpointing", "compile", "bf16_residual", "fp8", "dropout",
            "attention", "dropout_mask", "packing", "compile_mode", "steps", "warmup",
            "num_batches",
            "short_seq_prob", "seed")},
        "peak_tflops": peak, "peak_source": peak_source, "matmul_reference": reference,
        "flops_accounting": {
            "needed": "per row at its real length (no padding); MLM head and last layer at "
                      "[CLS] + labelled positions only; 3x forward (training.flops)",
            "computed": "padded width; MLM head at labelled positions; last layer at "
                        "[CLS] + max labels per row (as training.model runs it)",
            "mfu": "needed TFLOP/s over peak_tflops x world_size",
        },
        "results": results,
    }
    if rank != 0:
        return report
    json_path, md_path = output_paths(args.output_dir, name, report["environment"]["date"],
                                      args.tag)
    report["files"] = {"json": json_path, "markdown": md_path}
    write_report(report)  # ours first: a peer cut short by a time limit leaves them written
    if world_size == 1 and peer_runs(args):
        run_peers(args, cases, report)
    print("\n" + markdown(report))
    print(f"wrote {json_path}\nwrote {md_path}")
    return report


def write_report(report: dict[str, Any]) -> None:
    with open(report["files"]["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    with open(report["files"]["markdown"], "w", encoding="utf-8") as f:
        f.write(markdown(report))


if __name__ == "__main__":
    main()
