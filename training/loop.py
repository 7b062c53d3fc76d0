"""The pretraining loop. Runs under Ray Train, `torchrun`, the `deepspeed` launcher or alone."""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from bertforge.pipelines.contract.manifest import VOCAB_NAME
from bertforge.training import checkpoint
from bertforge.training.config import TrainConfig
from bertforge.training.data import (
    MaskingOptions,
    PackingOptions,
    PretrainingLoader,
    ReadOptions,
)
from bertforge.training.data.download import dataset_on_this_node
from bertforge.training.dataset_facts import DatasetFacts
from bertforge.training.device import to_device
from bertforge.training.distributed import all_reduce_sum, barrier
from bertforge.training.engine import build_engine, ensure_process_group
from bertforge.training.errors import DivergedError, UserInputError, as_user_error
from bertforge.training.evaluate import evaluate, most_frequent_token
from bertforge.training.flops import mfu, mlm_head_flops, training_flops_per_batch
from bertforge.training.host_gc import FrozenSurvivors
from bertforge.training.inputs import (
    check_positions,
    check_precision_change,
    check_zero_stage_change,
    resolve_model_config,
)
from bertforge.training.metrics import MetricsLogger, console, counted
from bertforge.training.model import IGNORE_INDEX, BertConfig, BertForPreTraining, num_parameters
from bertforge.training.profiling import StepProfiler
from bertforge.training.resolved_engine import (
    DECIDED,
    PrecisionChoice,
    bf16_autocast,
    resolve_engine,
)
from bertforge.training.resume_settings import RECORDED, recorded_settings
from bertforge.training.warm_start import check_resume_architecture, load_initial_weights

T = TypeVar("T")

# Called on every rank after each committed checkpoint with {"step", "checkpoint_path", ...}.
ReportFn = Callable[[dict[str, Any]], None]


@dataclass
class TrainResult:
    global_step: int
    checkpoint_path: str
    loss_first: float | None  # None when this call only resumed a finished run
    loss_last: float | None
    tokens_per_second: float
    train_seconds: float
    run_id: str = ""  # the run whose weights checkpoint_path holds (checkpoint.new_run_id)
    # Of train_seconds, the time the loop spent saving checkpoints (the training stood still).
    checkpoint_seconds: float = 0.0


def train(cfg: TrainConfig, *, report: ReportFn | None = None,
          run_id: str | None = None, derived: tuple[str, ...] | None = None) -> TrainResult:
    """Train to cfg.max_steps, resuming from the newest complete checkpoint when cfg.resume.

    `run_id`: the id a launch gave its new run (--resume never on Ray): a worker group that
    Ray restarts after a failure continues this run's own newest checkpoint, where a fresh
    start would move it aside with the older runs' and train from step 0 again. `derived`:
    the settings the command left to follow max_steps (default `cfg.derived`; a config sent
    as a dict to a worker has lost them)."""
    ensure_process_group()
    # Before the device decides anything: a resume's defaults.
    asked = recorded_settings(cfg, cfg.derived if derived is None else derived)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # A gs:// or s3:// dataset is read from a copy on this node; records name the URI.
    data_source = cfg.data_dir if "://" in cfg.data_dir else os.path.abspath(cfg.data_dir)
    splits = ("train", "validation") if cfg.eval_every else ("train",)
    cfg = replace(cfg, data_dir=dataset_on_this_node(cfg.data_dir, splits))
    facts = DatasetFacts.read(cfg.data_dir)
    model_config = resolve_model_config(cfg.model, facts.vocab_size)
    check_positions(facts.max_seq_length, model_config, cfg.data_dir)
    # max_predictions None: the data's default (20 at 128 tokens, 80 at 512).
    requested_masking = MaskingOptions(cfg.max_predictions, cfg.mask_prob, cfg.whole_word_masking)
    masking = requested_masking.for_dataset(facts)
    newest = checkpoint.latest_checkpoint(cfg.run_dir)
    # A new run (run_id given) continues only what it saved itself.
    own = run_id is not None and newest is not None and (
        checkpoint.checkpoint_run_id(newest) == run_id)
    resume_from = newest if cfg.resume or own else None
    saved = checkpoint.read_metadata(resume_from) if resume_from is not None else None
    if saved is not None:  # before any engine: a raw 'size mismatch' would say much less
        # Again here: a checkpoint restored from storage was not there for the pre-flight.
        check_resume_architecture(saved, model_config, resume_from, facts, cfg.data_dir)
    # What depends on the machine (precision "auto", the ZeRO stage, compiling, the
    # micro-batch, the residual stream), decided once, on the worker's device, with the world
    # size known; a resume keeps its own precision, stage and stream. From here on cfg names
    # them all: the printed recipe, config.json, checkpoint metadata.
    try:
        resolved = resolve_engine(
            cfg.engine(), world_size, saved=saved, num_parameters=count_parameters(model_config),
            max_seq_length=facts.max_seq_length)
    except ValueError as error:  # settings this device refuses (fp16 on a CPU): no retry helps;
        raise as_user_error(error) from None  # a Ray worker retried it, four tracebacks
    cfg = replace(cfg, **{name: getattr(resolved.config, name) for name in DECIDED})
    accumulation = cfg.accumulation_steps(world_size)
    if saved is not None:
        check_precision_change(saved, cfg, resume_from)
    if rank == 0:
        _print_recipe(cfg, model_config, world_size)
        _print_precision(resolved.precision)

    # Another number of workers under ZeRO >= 1: load through DeepSpeed's universal format.
    universal = saved is not None and check_world_size_change(saved, cfg, resume_from)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = BertForPreTraining(model_config)
    model.gradient_checkpointing = cfg.activation_checkpointing
    # Position embeddings trained so far: this run's length, and what its weights came with.
    positions_trained = facts.max_seq_length
    if saved is not None:
        positions_trained = max(positions_trained, checkpoint.positions_trained(saved))
    # Where the run's first weights came from, kept through its resumes (its checkpoints'
    # bertforge.json, config.json): --init-from names a run, whose newest checkpoint then
    # moves on, and the checkpoint actually read was said once, on the console.
    warm_start = (saved or {}).get("warm_start")
    if resume_from is None and cfg.init_from:
        # Only a fresh run warm-starts; a resumed one has its own, newer weights.
        initial = load_initial_weights(model, cfg.init_from, facts.vocab_sha256)
        warm_start = initial.record()
        positions_trained = max(positions_trained, initial.positions_trained)
        if rank == 0:  # a warm start said nothing: a run from scratch looked the same
            console(f"[train] warm start: weights from {initial.describe()}; the optimizer, "
                    "the learning-rate schedule and the data order start anew")
        if initial.lacking and rank == 0:
            console(f"[train] init_from {cfg.init_from} has no {' and no '.join(initial.lacking)}"
                    " (a model saved with another head): they start from a fresh initialisation")
        if initial.vocab_sha256 is None and rank == 0:
            console(f"[train] warning: init_from {cfg.init_from} has no vocab.txt or "
                    "tokenizer.json, so its vocabulary is not checked against the data's: its "
                    "embeddings are right only if it was trained with the data's vocabulary")
    engine = build_engine(model, resolved, load_universal=universal)
    # A run keeps its id across resumes (one saved before runs had ids gets one now).
    run_id = (saved or {}).get("run_id") or run_id or checkpoint.new_run_id()
    if resume_from is None:
        moved_to = _start_fresh(cfg.run_dir, run_id, rank, engine.device)
        if moved_to is not None and cfg.init_from:
            # `--init-from RUN --resume never`: the weights came from what is now under
            # RUN/previous/ID; config.json named RUN, whose newest checkpoint is this run's.
            cfg = replace(cfg, init_from=moved_path(cfg.init_from, cfg.run_dir, moved_to))
            warm_start = {**warm_start, "init_from": cfg.init_from, "checkpoint": moved_path(
                warm_start["checkpoint"], cfg.run_dir, moved_to)}
    loader = PretrainingLoader(
        cfg.data_dir, "train", batch_size=cfg.micro_batch_size, seed=cfg.seed,
        rank=rank, world_size=world_size, masking=masking, prefetch=cfg.dataloader_prefetch,
        packing=PackingOptions() if cfg.packing else None,
        gradient_accumulation_steps=accumulation,  # epochs end on an optimizer step
        read=ReadOptions(verify_checksums=cfg.verify_checksums),
    )
    # The loader's bound on labels per row: the sparse head runs on that many slots, so a step
    # never waits for the device to say how many labels a batch holds.
    model.max_predictions = loader.max_predictions_per_row
    step, resumed_config = _maybe_resume(engine, loader, cfg, resume_from, facts.vocab_sha256,
                                         universal)
    if resume_from is not None and cfg.init_from:
        # config.json says what the run started from: what its checkpoint recorded, not this
        # command's.
        started_from = resumed_config.get("init_from")
        if rank == 0 and started_from != cfg.init_from:
            console(f"[train] --init-from {cfg.init_from} not used: the run resumes from its "
                    f"own checkpoint {resume_from} (only a new run warm-starts)")
        cfg = replace(cfg, init_from=started_from)
    if rank == 0:
        # The accumulation used: --global-batch-size derives it from the workers, and a
        # --grad-accum beside it is ignored (config.json said the ignored one).
        _write_run_config(replace(cfg, data_dir=data_source,
                                  gradient_accumulation_steps=accumulation),
                          model_config, world_size, resolved.precision, warm_start)
    validation = _Validation.create(cfg, rank, world_size, masking, facts)

    # A fresh start continues from step 0: what an attempt stopped before its first save
    # logged is dropped too (its steps are trained again; they were in metrics.jsonl twice).
    logger = MetricsLogger(cfg.run_dir, enabled=rank == 0, max_steps=cfg.max_steps,
                           resumed_step=step)
    metadata = {
        "run_id": run_id,
        "vocab_sha256": facts.vocab_sha256,
        "lower_case": facts.lower_case,
        "model_config": model_config.to_dict(),
        "max_seq_length": facts.max_seq_length,
        "positions_trained": positions_trained,  # exports and fine-tunes read it
        "warm_start": warm_start,  # None: a run from scratch
        "data_dir": data_source,
        "world_size": world_size,
        "zero_stage": cfg.zero_stage,
        "precision": cfg.precision,
        "precision_requested": resolved.precision.requested,
        # bf16 at stage 0 keeps fp32 weights under torch.autocast (training.engine); before,
        # DeepSpeed kept bf16 weights there, with another optimizer state layout.
        "bf16_weights": cfg.precision == "bf16" and not bf16_autocast(resolved.config),
        # The residual stream's dtype under autocast: a resume keeps it (resolved_engine).
        "bf16_residual": cfg.bf16_residual,
        # `bertforge eval` masks the validation split as this run did: its seed and masking.
        "seed": cfg.seed,
        # What a resume must keep, checked by the driver before Ray (training.inputs): the
        # data order's size and the optimizer whose state the checkpoint holds.
        "train_samples": loader.num_samples,
        "train_sha256": facts.train_sha256,  # and which samples, in which order
        "optimizer": cfg.optimizer,
        "masking": asdict(requested_masking),  # another dataset: its own default predictions
        RECORDED: asked,  # what a resume that names no setting keeps (training.resume_settings)
    }
    client_state = {"vocab_sha256": facts.vocab_sha256, "config": cfg.to_dict()}
    batches = _endless(loader)
    last_saved = resume_from  # the checkpoint that holds this run's newest weights
    first_loss = last_loss = None
    window = _Window(model_config, cfg.peak_tflops, world_size, engine.device,
                     loader.max_predictions_per_row)
    started = time.time()
    total_tokens = 0
    checkpoint_seconds = 0.0
    profiler = StepProfiler(cfg.profile_steps, cfg.run_dir, rank, engine.device)
    save_clock = _SaveClock(cfg.checkpoint_minutes)
    survivors = FrozenSurvivors()  # no full collection's pause inside the steps (host_gc)
    first_step = True
    with profiler, survivors:
        while step < cfg.max_steps:
            profiler.begin(step + 1)
            lr = engine.get_lr()[0]  # the rate this step trains at: its scheduler moves on in it
            for _ in range(accumulation):
                batch = to_device(next(batches), engine.device)
                out = engine(**batch)
                engine.backward(out.loss)
                engine.step()
                window.add(out, batch)
            step += 1
            log_line = step == 1 or step % cfg.log_every == 0 or step == cfg.max_steps
            save_by_time = False
            if log_line:
                metrics, save_by_time = window.reduce(lr, save_clock.due())
                total_tokens += metrics["tokens"]
                logger.log(step, metrics)
                if not math.isfinite(metrics["loss"]):
                    raise _diverged(metrics["loss"], step, last_loss, last_saved)
                first_loss = metrics["loss"] if first_loss is None else first_loss
                last_loss = metrics["loss"]
            if first_step or log_line:  # after the first step's compile; at log lines the
                survivors.freeze()       # host has waited for the device anyway
                first_step = False
            if validation is not None and step % cfg.eval_every == 0:
                # Evaluation time is no training throughput.
                logger.log(step, window.left_out(validation.run, engine))
            if (step == cfg.max_steps or save_by_time
                    or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                if not log_line and not window.loss_finite():  # no checkpoint of NaN weights
                    raise _diverged(math.nan, step, last_loss, last_saved)
                loader.wait_for_checksums()  # no checkpoint from shards not yet verified
                client_state.update(loader=loader.state_dict(), global_step=step)
                saving = time.time()
                path = last_saved = window.left_out(
                    checkpoint.save, engine, cfg.run_dir, step, client_state, metadata=metadata,
                    vocab_path=os.path.join(cfg.data_dir, VOCAB_NAME), keep=cfg.keep_checkpoints,
                )
                checkpoint_seconds += time.time() - saving
                save_clock.saved()
                if report is not None:
                    report({"step": step, "checkpoint_path": path, "loss": last_loss,
                            "run_id": run_id})
            profiler.end(step)
    logger.close()
    seconds = time.time() - started
    if rank == 0:
        console(f"[train] run {run_id}: step {step}, weights in {last_saved}")
    return TrainResult(
        global_step=step,
        checkpoint_path=last_saved,
        run_id=run_id,
        loss_first=first_loss,
        loss_last=last_loss,
        tokens_per_second=total_tokens / seconds if seconds > 0 else 0.0,
        train_seconds=seconds,
        checkpoint_seconds=checkpoint_seconds,
    )


def _diverged(loss: float, step: int, last_loss: float | None,
              last_saved: str | None) -> DivergedError:
    """The run's end when its loss is no longer a number (a learning rate too high, an Adam
    epsilon of 0, bad data): it trained on, saved and exported NaN weights, and exited 0."""
    before = f", {last_loss:.4g} at the log line before" if last_loss is not None else ""
    saved = (f"the newest checkpoint, {last_saved}, holds the weights before it"
             if last_saved else "no checkpoint of this run was saved")
    return DivergedError(f"the loss is {loss} by step {step}{before}: training diverged; {saved}. "
                         "Lower --lr or lengthen --warmup-steps")


def _start_fresh(run_dir: str, run_id: str, rank: int, device) -> str | None:
    """A new run (--resume never) on a directory that holds another run's checkpoints: rank 0
    moves them aside, with that run's metrics and config, before this run saves anything, and
    returns where (None elsewhere, and when there was nothing to move). Its checkpoints would
    otherwise mix with this run's, and `latest_checkpoint`, pruning and export would all go by
    step numbers across both runs."""
    target = None
    if rank == 0:
        moved = checkpoint.move_aside(run_dir)
        if moved is not None:
            target, steps = moved
            console(checkpoint.moved_aside_line(run_dir, run_id, target, steps))
    barrier(device)  # no rank saves into checkpoints/ before it is this run's alone
    return target


def moved_path(path: str, run_dir: str, moved_to: str) -> str:
    """Where `path` is once `run_dir`'s previous run moved to `moved_to`: the run directory
    becomes `moved_to`, its checkpoints move with it, and any other path stays."""
    inside = os.path.relpath(os.path.realpath(path), os.path.realpath(run_dir))
    if inside == os.curdir:
        return moved_to
    if inside.split(os.sep)[0] == checkpoint.CHECKPOINTS_DIR:
        return os.path.join(moved_to, inside)
    return path


def count_parameters(model_config: BertConfig) -> int:
    """The model's parameter count, from a model on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return num_parameters(BertForPreTraining(model_config))


def _print_recipe(cfg: TrainConfig, model_config: BertConfig, world_size: int) -> None:
    """Two lines; every field of both is in RUN_DIR/config.json (a 45-line dump here used to
    push the progress lines off a terminal)."""
    accumulation = cfg.accumulation_steps(world_size)
    console(
        f"[train] recipe: {counted(world_size, 'worker')} x {cfg.micro_batch_size} micro x "
        f"{accumulation} accumulation = {cfg.global_batch(world_size)} sequences per step, "
        f"{cfg.max_steps} steps, {cfg.optimizer} lr {cfg.learning_rate:g} (warm-up "
        f"{cfg.warmup_steps}, {cfg.decay} decay), ZeRO {cfg.zero_stage}"
        f"{', compiled layers' if cfg.compile else ''}"
        f"{', bf16 residual stream' if cfg.bf16_residual else ''}"
        f"{', FP8 GEMMs' if cfg.fp8 else ''}; all of it in "
        f"{os.path.join(cfg.run_dir, 'config.json')}\n"
        f"[train] model: {model_config.num_hidden_layers} layers, hidden "
        f"{model_config.hidden_size}, {model_config.num_attention_heads} heads, vocab "
        f"{model_config.vocab_size} ({count_parameters(model_config) / 1e6:.1f}M parameters)"
    )
    if cfg.eval_every > cfg.max_steps:
        # Not refused: recipes shorten runs by overriding --steps and keep their cadence.
        console(f"[train] no validation pass in this run: --eval-every {cfg.eval_every} is "
                f"past its last step ({cfg.max_steps})")


def _print_precision(choice: PrecisionChoice) -> None:
    console(f"[train] precision {choice.resolved} (asked: {choice.requested}): {choice.reason}")
    if choice.warning:
        console(f"[train] WARNING: {choice.warning}")


def _maybe_resume(
    engine, loader: PretrainingLoader, cfg: TrainConfig, path: str | None, vocab_sha256: str,
    universal: bool,
) -> tuple[int, dict[str, Any]]:
    """The global step to start from, 0 or that of the checkpoint at `path`, and the training
    config that checkpoint was saved with ({} for none)."""
    if path is None:
        return 0, {}
    saved = checkpoint.read_metadata(path)
    saved_sha256 = saved["vocab_sha256"]
    if saved_sha256 != vocab_sha256:  # checked first: loading would fail on shapes, unclearly
        raise UserInputError(
            f"{path} was trained with another vocabulary than {cfg.data_dir} "
            f"(vocab sha256 {saved_sha256[:12]} vs {vocab_sha256[:12]})"
        )
    state = checkpoint.load(engine, path, universal=universal,
                            saved_world_size=saved.get("world_size"))
    # The loader keeps its position in samples: a resume on another number of workers, with
    # accumulation keeping the optimizer step's batch (2 x 8 x 1 -> 1 x 8 x 2), continues
    # with the same samples in every step.
    try:
        loader.load_state_dict(state["loader"])
    except ValueError as error:  # a batch layout that cannot continue its position: every
        # attempt fails alike (it was retried, four tracebacks a worker)
        raise UserInputError(f"{path}: {error}") from error
    saved_config = state.get("config") or {}  # the TrainConfig it was saved with
    if dist.get_rank() == 0:
        cut = checkpoint.cut_saves(cfg.run_dir, after=state["global_step"])
        # Said: the step folder of a save a kill cut short looked like a newer checkpoint.
        console(f"[train] resumed from {path} at step {state['global_step']}" + (
            f" (the save of step {', '.join(map(str, cut))} was cut short: not a checkpoint, "
            "its files are cleared)" if cut else ""))
        before = saved_global_batch(saved_config, saved.get("world_size"))
        now = cfg.global_batch(dist.get_world_size())
        if before is not None and before != now:  # another --batch-size or --workers: no word
            console(f"[train] a step is {now} sequences from here (the checkpoint's run's were "
                    f"{before}): another --batch-size, --workers, --global-batch-size or "
                    "--recipe than the run's")
    changes = schedule_changes(saved_config, cfg)
    if changes:
        scheduler = engine.lr_scheduler
        restored = scheduler.optimizer.param_groups[0]["lr"]  # the checkpoint's plan's next
        follow_this_runs_schedule(scheduler, cfg.learning_rate)
        if dist.get_rank() == 0:
            console(f"[train] the learning-rate schedule follows this run's settings: "
                    f"{changes}; step {state['global_step'] + 1} trains at lr "
                    f"{scheduler.optimizer.param_groups[0]['lr']:.3g} where the checkpoint's "
                    f"plan had {restored:.3g}")
    return state["global_step"], saved_config


def saved_global_batch(saved_config: dict[str, Any], world_size: int | None) -> int | None:
    """Sequences per optimizer step of the run a checkpoint was saved by (None: a checkpoint
    too old to say)."""
    if not saved_config or not world_size:
        return None
    try:
        return TrainConfig.from_dict(saved_config).global_batch(world_size)
    except (TypeError, ValueError, AssertionError):
        return None


# What makes the learning-rate schedule: the rate at a step is a function of these alone.
SCHEDULE_FIELDS = ("learning_rate", "max_steps", "warmup_steps", "decay", "decay_power")


def schedule_changes(saved_config: dict[str, Any], cfg: TrainConfig) -> str:
    """The schedule settings (another --steps, warm-up, --lr, decay) this resume changes, as
    "max_steps 10 (was 6)", ...; "" where the schedule is the checkpoint's (or a checkpoint
    too old to say). Extending a finished run's --steps takes the rate from the old plan's 0
    back up, with no word said before."""
    if any(saved_config.get(name) is None for name in SCHEDULE_FIELDS):
        return ""

    def shown(value: Any) -> str:
        return f"{value:g}" if isinstance(value, (int, float)) else str(value)

    return ", ".join(f"{name} {shown(getattr(cfg, name))} (was {shown(saved_config[name])})"
                     for name in SCHEDULE_FIELDS if getattr(cfg, name) != saved_config[name])


def follow_this_runs_schedule(scheduler, learning_rate: float) -> None:
    """Put this run's schedule in effect from the next step. A load restores the optimizer's
    rate (the saved plan's next one) and the scheduler's peak: the first step after a resume
    trained at the old plan's rate (an extended finished run: lr 0) and another --lr never
    took effect. The scheduler's rule (`lr_lambdas`) is this run's already; its step count is
    the checkpoint's."""
    scheduler.base_lrs = [learning_rate] * len(scheduler.base_lrs)
    for group, rule in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * rule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def check_world_size_change(saved: dict[str, Any], cfg: TrainConfig, path: str) -> bool:
    """True when the checkpoint must be loaded as a universal checkpoint.

    ZeRO >= 1 shards the optimizer state by rank and DeepSpeed cannot re-shard it in a plain
    load; a resume on another number of workers converts the checkpoint to DeepSpeed's
    universal format first. ZeRO 0 keeps whole states and loads on any number of workers.
    """
    saved_world, saved_stage = saved.get("world_size"), saved.get("zero_stage")
    world_size = dist.get_world_size()
    check_zero_stage_change(saved, cfg.zero_stage, world_size, path)
    if saved_world in (None, world_size) or saved_stage == 0:
        return False
    if saved_stage is None:  # saved before stages were recorded: its layout is unknown
        workers = counted(saved_world, "worker")
        raise UserInputError(f"{path} was saved by {workers} under an unrecorded ZeRO stage; "
                             f"resume it on {workers}")
    return True


def _endless(loader: PretrainingLoader) -> Iterator[dict[str, torch.Tensor]]:
    """Batches across epoch boundaries; each epoch draws a new order and new masks."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise ValueError(
                f"the training split has fewer samples than one global batch "
                f"({loader.batch_size} x {loader.world_size})"
            )
        loader.set_epoch(loader.epoch + 1)


class _Window:
    """Loss and throughput since the last log line, summed over all ranks.

    Nothing is read back from the device per micro-step: losses and counts accumulate in a
    tensor on the engine's device and the host keeps only what shapes tell (micro-batches,
    FLOPs but the head's); `reduce` all-reduces both at once and reads the result: one host
    sync per log interval. (The `.item()`s this replaced were 6 syncs per micro-step, each
    draining the GPU's queue and idling it while Python caught up.)
    """

    def __init__(
        self, model_config: BertConfig, peak_tflops: float | None, world_size: int,
        device: torch.device, max_predictions: int,
    ):
        self.model_config = model_config
        self.peak_tflops = peak_tflops
        self.world_size = world_size
        self.device = device  # NCCL takes no CPU tensor: the sums live where the engine trains
        self.max_predictions = max_predictions  # the model's sparse-head slots a row
        # The head's FLOPs are linear in the labels, so they are counted on the device:
        # 3 x (2h^2 + 2hV) per prediction (~194 MFLOP for BERT-large).
        self.flops_per_prediction = 3 * mlm_head_flops(
            hidden_size=model_config.hidden_size, vocab_size=model_config.vocab_size,
            num_predictions=1,
        )
        self._reset()

    def _reset(self) -> None:
        # On the device: loss, mlm, nsp (sums over micro-batches), real tokens, sequences
        # (instances: a packed row holds several, each with its NSP label), predictions.
        self.device_sums = torch.zeros(6, dtype=torch.float64, device=self.device)
        # On the host, from shapes: micro-batches, FLOPs without the MLM head's.
        self.host_sums = [0, 0]
        self.started = time.time()

    def left_out(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`work(...)` (an evaluation, a checkpoint) with its time left out of the interval's,
        whose steps before it stay counted and timed (restarting the clock dropped their time
        and kept their sequences: 2x the throughput). The device is waited for first, so the
        steps it has queued are timed as theirs: once per evaluation or checkpoint, no step's."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        paused = time.time()
        try:
            return work(*args, **kwargs)
        finally:
            self.started += time.time() - paused

    def add(self, out, batch: dict[str, torch.Tensor]) -> None:
        values = (out.loss, out.mlm_loss, out.nsp_loss, batch["attention_mask"].sum(),
                  (batch["next_sentence_label"] != IGNORE_INDEX).sum(),
                  (batch["labels"] != IGNORE_INDEX).sum())
        self.device_sums += torch.stack([value.detach().double() for value in values])
        self.host_sums[0] += 1
        self.host_sums[1] += self._flops_without_head(batch)

    def _flops_without_head(self, batch: dict[str, torch.Tensor]) -> int:
        """FLOPs of a micro-batch at its real padded width (the loader pads each batch only
        to its longest row), the MLM head apart: that one is the device's count of labels
        x `flops_per_prediction`, the head running on the labelled positions only."""
        batch_size, width = batch["input_ids"].shape
        # The last layer runs on the [CLS] column(s) + the head's slots (model.output_rows).
        num_cls = batch["cls_positions"].shape[1] if "cls_positions" in batch else 1
        c = self.model_config
        return training_flops_per_batch(
            num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
            batch_size=batch_size, seq_len=width, num_predictions=0,
            last_layer_rows=num_cls + min(self.max_predictions, width) if batch_size else 0,
        )

    def loss_finite(self) -> bool:
        """Whether the loss since the last log line is a number on every rank (one all-reduce
        and a host sync: called where the host waits anyway, before a checkpoint)."""
        loss = all_reduce_sum(self.device_sums[:1].clone(), self.device)
        return math.isfinite(loss.item())

    def reduce(self, lr: float, save_due: bool = False) -> tuple[dict[str, Any], bool]:
        """The interval's metrics, and whether any rank found a save due (`save_due`: this
        rank's vote, carried in the same all-reduce: every rank gets the same answer without
        a collective of its own); `lr`: the rate the interval's last step trained at."""
        host = torch.tensor([*self.host_sums, float(save_due)], dtype=torch.float64,
                            device=self.device)
        sums = all_reduce_sum(torch.cat([self.device_sums, host]), self.device)
        values = sums.tolist()  # the one host sync of the interval
        loss, mlm, nsp, tokens, sequences, predictions, micro_batches, flops, votes = values
        flops += predictions * self.flops_per_prediction
        # Timed after the sync: the interval's queued GPU work is done, and none of it is
        # counted in the next interval.
        seconds = max(time.time() - self.started, 1e-9)
        self._reset()
        tflops = flops / seconds / 1e12  # all ranks together
        metrics = {
            "loss": loss / micro_batches,
            "mlm_loss": mlm / micro_batches,
            "nsp_loss": nsp / micro_batches,
            "lr": lr,
            "seq_per_s": sequences / seconds,
            "tokens_per_s": tokens / seconds,
            "tokens": int(tokens),
            "tflops": tflops,
        }
        if self.peak_tflops is not None:
            metrics["mfu"] = mfu(
                tflops, peak_tflops_per_device=self.peak_tflops, world_size=self.world_size
            )
        return metrics, votes > 0


class _SaveClock:
    """Whether `minutes` (0: never) have passed since the run's last save, or since this
    process started training. Each rank asks its own clock; `_Window.reduce` makes one answer
    of their votes."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


class _Validation:
    """Periodic masked-LM/NSP evaluation on the validation split, sharded across the ranks.

    Fixed masks and order (seed, epoch 0), restarted at its first batch every time, so the
    numbers of different steps compare the model and nothing else.
    """

    def __init__(self, loader: PretrainingLoader, max_batches: int, baseline_token_id: int):
        self.loader = loader
        self.max_batches = max_batches
        self.baseline_token_id = baseline_token_id
        self.start_state = loader.state_dict()

    @classmethod
    def create(cls, cfg: TrainConfig, rank: int, world_size: int, masking: MaskingOptions,
               facts: DatasetFacts):
        if not cfg.eval_every:
            return None
        from bertforge.training.data import token_frequencies

        # Every row, the last partial batch's too (drop_last=False), as `bertforge eval`
        # scores them: the run's numbers and eval's of the same checkpoint were those of 64
        # and 70 rows of a 70-row split. A rank the partial batch leaves no row runs a blank
        # one (`every_rank_a_row`). The micro-batch a device allows may exceed a small split
        # (512 on an H200 against the 269 rows of a proof run's split, seen through Ray Train
        # there): evaluate in batches the split fills on every rank.
        rows = facts.split_sizes.get("validation", 0)
        batch_size = cfg.micro_batch_size
        if rows >= world_size:
            batch_size = min(batch_size, rows // world_size)
        loader = PretrainingLoader(
            cfg.data_dir, "validation", batch_size=batch_size, seed=cfg.seed,
            rank=rank, world_size=world_size, masking=masking, prefetch=0, drop_last=False,
            read=ReadOptions(verify_checksums=cfg.verify_checksums),
        )
        # The baseline guess from the validation tokens: the train split may be terabytes.
        baseline = most_frequent_token(token_frequencies(cfg.data_dir, "validation"), cfg.data_dir)
        return cls(loader, cfg.eval_batches, baseline)

    def run(self, engine) -> dict[str, float]:
        self.loader.load_state_dict(self.start_state)
        batches = every_rank_a_row(self.loader)
        if self.max_batches:
            batches = itertools.islice(batches, self.max_batches)
        # The engine (not engine.module) so that ZeRO-3 gathers its partitioned parameters;
        # `evaluate` switches to eval mode (no dropout) and restores train mode after.
        result = evaluate(engine, batches, baseline_token_id=self.baseline_token_id,
                          device=engine.device)
        return {
            "eval_mlm_accuracy": result.mlm_accuracy,
            "eval_nsp_accuracy": result.nsp_accuracy,
            "eval_mlm_loss": result.mlm_loss,
            "eval_nsp_loss": result.nsp_loss,
            "eval_mlm_baseline_accuracy": result.mlm_baseline_accuracy,
            # What it counted, as `bertforge eval` says of its own (num_sequences): whether
            # --eval-batches covered the split, and what the two numbers compare.
            "eval_sequences": result.num_sequences,
        }


def every_rank_a_row(batches) -> Iterator[dict[str, torch.Tensor]]:
    """`batches`, a batch of no row replaced by one blank row that nothing is scored on (no
    label, no NSP label): the last partial batch of a split can leave a rank without a row,
    and that rank must still run the forward pass (under ZeRO-3 every rank joins every
    parameter gather), on a row, since a forward on none makes NaN losses."""
    blank = None
    for batch in batches:
        if batch["input_ids"].shape[0]:
            yield batch
            continue
        if blank is None:
            blank = {name: torch.zeros((1, *tensor.shape[1:]), dtype=tensor.dtype)
                     for name, tensor in batch.items()}
            blank["attention_mask"].fill_(1)  # a row attending to nothing divides by 0
            blank["labels"].fill_(IGNORE_INDEX)
            blank["next_sentence_label"].fill_(IGNORE_INDEX)
        yield blank


def _write_run_config(
    cfg: TrainConfig, model_config: BertConfig, world_size: int, precision: PrecisionChoice,
    warm_start: dict[str, Any] | None = None,
) -> None:
    os.makedirs(cfg.run_dir, exist_ok=True)
    # train.precision is the resolved one; "precision" also says what was asked for and why;
    # "warm_start" which checkpoint train.init_from gave the run its first weights.
    resolved = {"train": cfg.to_dict(), "model": model_config.to_dict(), "world_size": world_size,
                "precision": precision.to_dict(), "warm_start": warm_start}
    with open(os.path.join(cfg.run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(resolved, f, indent=2, sort_keys=True)
