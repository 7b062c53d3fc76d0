"""The pretraining loop. Runs under Ray Train, `torchrun`, the `deepspeed` launcher or alone."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipelines.manifest import VOCAB_NAME, read_manifest
from training import checkpoint
from training.config import TrainConfig
from training.data import PretrainingLoader
from training.engine import build_engine, ensure_process_group
from training.flops import training_flops_per_sequence
from training.masking import default_max_predictions
from training.metrics import MetricsLogger
from training.model import BertConfig, BertForPreTraining

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


def resolve_model_config(model: dict[str, Any], vocab_size: int) -> BertConfig:
    """`{"preset": "tiny", ...overrides}` or explicit fields; vocab_size always from the data."""
    fields = dict(model)
    preset = fields.pop("preset", None)
    if preset is not None:
        base = BertConfig.preset(preset, vocab_size=vocab_size).to_dict()
        base.update(fields)
        fields = base
    fields["vocab_size"] = vocab_size
    return BertConfig.from_dict(fields)


def train(cfg: TrainConfig, *, report: ReportFn | None = None) -> TrainResult:
    """Train to cfg.max_steps, resuming from the newest complete checkpoint when cfg.resume."""
    ensure_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    manifest = read_manifest(cfg.data_dir)
    model_config = resolve_model_config(cfg.model, manifest.tokenizer.vocab_size)
    max_seq_length = manifest.instance_params["max_seq_length"]
    max_predictions = cfg.max_predictions or default_max_predictions(max_seq_length, cfg.mask_prob)

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    engine = build_engine(BertForPreTraining(model_config), cfg, world_size)
    loader = PretrainingLoader(
        cfg.data_dir, "train", batch_size=cfg.micro_batch_size, seed=cfg.seed,
        rank=rank, world_size=world_size, max_predictions=max_predictions,
        mask_prob=cfg.mask_prob, whole_word=cfg.whole_word_masking,
        prefetch=cfg.dataloader_prefetch,
    )
    step = _maybe_resume(engine, loader, cfg, manifest.tokenizer.vocab_sha256)
    if rank == 0:
        _write_run_config(cfg, model_config, world_size)

    logger = MetricsLogger(cfg.run_dir, enabled=rank == 0, max_steps=cfg.max_steps)
    flops_per_seq = training_flops_per_sequence(
        num_layers=model_config.num_hidden_layers, hidden_size=model_config.hidden_size,
        intermediate_size=model_config.intermediate_size, vocab_size=model_config.vocab_size,
        seq_len=max_seq_length, num_predictions=max_predictions,
    )
    metadata = {
        "vocab_sha256": manifest.tokenizer.vocab_sha256,
        "lower_case": manifest.tokenizer.lower_case,
        "model_config": model_config.to_dict(),
        "max_seq_length": max_seq_length,
        "data_dir": os.path.abspath(cfg.data_dir),
    }
    client_state = {"vocab_sha256": manifest.tokenizer.vocab_sha256, "config": cfg.to_dict()}
    batches = _endless(loader)
    first_loss = last_loss = None
    window = _Window()
    started = time.time()
    total_tokens = 0
    while step < cfg.max_steps:
        for _ in range(cfg.gradient_accumulation_steps):
            batch = {k: v.to(engine.device) for k, v in next(batches).items()}
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            window.add(out, batch)
        step += 1
        if step == 1 or step % cfg.log_every == 0 or step == cfg.max_steps:
            metrics = window.reduce(engine, flops_per_seq)
            total_tokens += metrics["tokens"]
            first_loss = metrics["loss"] if first_loss is None else first_loss
            last_loss = metrics["loss"]
            logger.log(step, metrics)
        if step == cfg.max_steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            client_state.update(loader=loader.state_dict(), global_step=step)
            path = checkpoint.save(
                engine, cfg.run_dir, step, client_state, metadata=metadata,
                vocab_path=os.path.join(cfg.data_dir, VOCAB_NAME), keep=cfg.keep_checkpoints,
            )
            if report is not None:
                report({"step": step, "checkpoint_path": path, "loss": last_loss})
    logger.close()
    seconds = time.time() - started
    return TrainResult(
        global_step=step,
        checkpoint_path=checkpoint.latest_checkpoint(cfg.run_dir),
        loss_first=first_loss,
        loss_last=last_loss,
        tokens_per_second=total_tokens / seconds if seconds > 0 else 0.0,
        train_seconds=seconds,
    )


def _maybe_resume(engine, loader: PretrainingLoader, cfg: TrainConfig, vocab_sha256: str) -> int:
    """The global step to start from: 0, or that of the newest complete checkpoint."""
    path = checkpoint.latest_checkpoint(cfg.run_dir) if cfg.resume else None
    if path is None:
        return 0
    saved_sha256 = checkpoint.read_metadata(path)["vocab_sha256"]
    if saved_sha256 != vocab_sha256:  # checked first: loading would fail on shapes, unclearly
        raise ValueError(
            f"{path} was trained with another vocabulary than {cfg.data_dir} "
            f"(vocab sha256 {saved_sha256[:12]} vs {vocab_sha256[:12]})"
        )
    state = checkpoint.load(engine, path)
    loader.load_state_dict(state["loader"])
    if dist.get_rank() == 0:
        print(f"[train] resumed from {path} at step {state['global_step']}", flush=True)
    return state["global_step"]


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
    """Loss and throughput since the last log line, averaged over all ranks."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.sums = torch.zeros(5, dtype=torch.float64)  # loss, mlm, nsp, micro-batches, tokens
        self.sequences = 0
        self.started = time.time()

    def add(self, out, batch: dict[str, torch.Tensor]) -> None:
        self.sums += torch.tensor([
            out.loss.item(), out.mlm_loss.item(), out.nsp_loss.item(), 1.0,
            batch["attention_mask"].sum().item(),
        ], dtype=torch.float64)
        self.sequences += batch["input_ids"].shape[0]

    def reduce(self, engine, flops_per_seq: int) -> dict[str, Any]:
        sums = torch.cat([self.sums, torch.tensor([float(self.sequences)], dtype=torch.float64)])
        dist.all_reduce(sums)
        loss, mlm, nsp, micro_batches, tokens, sequences = sums.tolist()
        seconds = max(time.time() - self.started, 1e-9)
        self._reset()
        return {
            "loss": loss / micro_batches,
            "mlm_loss": mlm / micro_batches,
            "nsp_loss": nsp / micro_batches,
            "lr": engine.get_lr()[0],
            "seq_per_s": sequences / seconds,
            "tokens_per_s": tokens / seconds,
            "tokens": int(tokens),
            "tflops": sequences * flops_per_seq / seconds / 1e12,
        }


def _write_run_config(cfg: TrainConfig, model_config: BertConfig, world_size: int) -> None:
    os.makedirs(cfg.run_dir, exist_ok=True)
    resolved = {"train": cfg.to_dict(), "model": model_config.to_dict(), "world_size": world_size}
    with open(os.path.join(cfg.run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(resolved, f, indent=2, sort_keys=True)
