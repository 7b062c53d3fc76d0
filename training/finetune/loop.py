"""One fine-tuning run (one learning rate, one seed) on DeepSpeed; every worker calls `finetune`.

Runs under Ray Train (cluster/commands/finetune_sweep.py), `torchrun`, the `deepspeed` launcher or
alone, like the pretraining loop. The engine is pretraining's (`training.engine.build_engine`:
AdamW without decay on biases and LayerNorm, linear warm-up then linear decay to zero, ZeRO and
precision as pretraining decides them); only the data and the heads differ.

Data order: each epoch is a permutation drawn from (seed, epoch); a global batch of batch_size
examples is split across the ranks by stride, so every number of workers sees the same global
batches. The last partial batch of an epoch is dropped (Google's `drop_remainder`).
Dev is scored once, after training, sharded across the ranks; rank 0 writes the predictions,
the Hugging Face export and `result.json` in cfg.output.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bertforge.training.device import to_device  # pinned + non_blocking on CUDA: no sync
from bertforge.training.distributed import all_reduce_sum, barrier
from bertforge.training.engine import build_engine, ensure_process_group
from bertforge.training.engine_config import EngineConfig
from bertforge.training.finetune.config import HF_DIR_NAME, RESULT_NAME, FinetuneConfig
from bertforge.training.finetune.export import export_finetuned
from bertforge.training.finetune.load import load_pretrained
from bertforge.training.finetune.model import task_model
from bertforge.training.finetune.task_data import TaskData, load_task_data
from bertforge.training.host_gc import FrozenSurvivors
from bertforge.training.metrics import MetricsLogger, console, counted
from bertforge.training.resolved_engine import resolve_engine

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
TRAIN_TARGETS = ("labels", "start_positions", "end_positions")
SPAN_LOGITS = ("start_logits", "end_logits")  # one per token: SQuAD

ReportFn = Callable[[dict[str, Any]], None]


def finetune(cfg: FinetuneConfig, *, report: ReportFn | None = None) -> dict[str, Any]:
    """Train on cfg.train at cfg.learning_rate with cfg.seeds[0], score cfg.dev, write the
    outputs into cfg.output (rank 0); returns the run's record (also in output/result.json)."""
    # The pretrained model's vocabulary is read until the export: a copy of it lives here (a
    # train still running in MODEL's run may remove the checkpoint meanwhile). In the run's own
    # folder, not the temporary directory: a worker killed mid-run (SIGKILL, the OOM killer)
    # left its copy in /tmp for good, where the rerun of an unfinished run starts its folder
    # afresh (finetune_sweep).
    os.makedirs(cfg.output, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".scratch-", dir=cfg.output) as scratch:
        return _finetune(cfg, report, scratch)


def _finetune(cfg: FinetuneConfig, report: ReportFn | None, scratch: str) -> dict[str, Any]:
    ensure_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed = cfg.seeds[0]
    pretrained = load_pretrained(cfg.model, random_init=cfg.random_init, vocab_copy_dir=scratch)
    data = load_task_data(cfg, pretrained.vocab_path, pretrained.lower_case)
    steps_per_epoch, num_steps = count_steps(cfg, data.num_train_rows)
    torch.manual_seed(seed)  # identical head (and random encoder) on every rank
    model = task_model(pretrained.config, data.num_labels)
    if pretrained.state_dict is None:
        model.init_encoder_randomly()
    else:
        model.load_encoder(pretrained.state_dict)
    resolved = resolve_engine(engine_config(cfg, num_steps, world_size), world_size)
    precision = resolved.config.precision
    if rank == 0:
        console(f"[finetune] {cfg.task}: lr {cfg.learning_rate:g}, seed {seed}, "
                f"{data.num_train_examples} train examples ({data.num_train_rows} rows), "
                f"{num_steps} steps of "
                f"{cfg.batch_size} ({counted(world_size, 'worker')}), {precision}")
        if "pooler" in pretrained.provenance and data.spec is not None:  # SQuAD has none
            console(f"[finetune] {cfg.model} has no pooler (a masked-LM-only save): the "
                    "classifier's pooler starts from random weights")
    torch.manual_seed(seed + rank)  # dropout: a different mask on every rank
    engine = build_engine(model, resolved)
    started = time.time()
    last_loss = _train(engine, data, cfg, steps_per_epoch, num_steps, seed)
    train_seconds = time.time() - started
    # The loss is every rank's sum, so all ranks agree. A diverged model's predictions are
    # NaN: scored, they gave numbers (a Spearman of 0.14 from all-NaN scores, class 0 for
    # every NaN logit) that a sweep could pick as its best.
    diverged = last_loss is not None and not math.isfinite(last_loss)
    metrics, predictions = ({}, None) if diverged else evaluate(engine, data, cfg)
    if rank == 0 and not diverged and predictions is None:  # NaN in the dev logits
        diverged = True
    record = {
        "task": cfg.task, "learning_rate": cfg.learning_rate, "seed": seed,
        "metrics": metrics, "diverged": diverged,
        "steps": num_steps, "epochs": num_steps / steps_per_epoch,
        "train_examples": data.num_train_examples, "train_rows": data.num_train_rows,
        "dev_examples": len(data.dev_examples),
        # Strict JSON has no NaN: a diverged run's loss is null, its `diverged` says why.
        "final_train_loss": last_loss if last_loss is None or math.isfinite(last_loss) else None,
        "train_seconds": round(train_seconds, 3),
        "world_size": world_size, "threads": torch.get_num_threads(),
        "precision": precision, "zero_stage": engine.zero_optimization_stage(),
        "bf16_residual": resolved.config.bf16_residual,
        "model": pretrained.provenance,
        **_against_chance(data, predictions),
    }
    if rank == 0:
        if not diverged:  # no predictions, and no export of NaN weights
            record.update(_write_outputs(engine.module, cfg, data, pretrained, predictions))
        _write_json(os.path.join(cfg.output, RESULT_NAME), record)
    barrier(engine.device)
    if report is not None:
        report(record)
    return record


def count_steps(cfg: FinetuneConfig, num_rows: int) -> tuple[int, int]:
    """(optimizer steps per epoch, total steps): epochs x full batches, or cfg.max_steps."""
    steps_per_epoch = num_rows // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{num_rows} training rows are fewer than one batch of "
                         f"{cfg.batch_size}; lower --batch-size")
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    return steps_per_epoch, total


def engine_config(cfg: FinetuneConfig, num_steps: int, world_size: int) -> EngineConfig:
    """This run's engine, built as pretraining's is (`build_engine`, after `resolve_engine`):
    AdamW, linear warm-up then linear decay, the engine options the config gives."""
    if cfg.batch_size % world_size:
        raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of the {world_size} "
                         "workers; change --batch-size or --workers")
    return EngineConfig(
        max_steps=num_steps, learning_rate=cfg.learning_rate,
        warmup_steps=int(cfg.warmup_fraction * num_steps),
        micro_batch_size=cfg.batch_size // world_size,  # one micro-step per optimizer step
        weight_decay=cfg.weight_decay, adam_eps=cfg.adam_eps,
        gradient_clipping=cfg.gradient_clipping, zero_stage=cfg.zero_stage,
        precision=cfg.precision, bf16_residual=cfg.bf16_residual,
    )


def batch_indices(num_rows: int, batch_size: int, step: int, steps_per_epoch: int,
                  seed: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's rows in optimizer step `step`: its stride of the global batch."""
    epoch, index = divmod(step, steps_per_epoch)
    order = epoch_order(num_rows, seed, epoch)
    return order[index * batch_size:(index + 1) * batch_size][rank::world_size]


@functools.lru_cache(maxsize=1)
def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of the rows, drawn once per epoch (not once per step: SQuAD's
    ~88k rows). Callers only slice it."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def _train(engine, data: TaskData, cfg: FinetuneConfig, steps_per_epoch: int, num_steps: int,
           seed: int) -> float | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    log_every = cfg.log_every or max(1, min(50, num_steps // 20))
    logger = MetricsLogger(cfg.output, enabled=rank == 0, max_steps=num_steps, prefix="finetune")
    tensors = {k: v for k, v in data.train.items() if k in MODEL_INPUTS + TRAIN_TARGETS}
    # Only the loss stays on the device, summed there; steps and rows are host ints, put into
    # a tensor at log time: a host->device copy per step would wait for the GPU each step.
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    window_steps = window_rows = 0
    window_start, last_loss = time.time(), None
    engine.train()
    # As pretraining's loop: no full collection's pause inside a step (training/host_gc.py);
    # the log lines, where the host reads the loss back anyway, freeze what survived since.
    with FrozenSurvivors() as survivors:
        for step in range(num_steps):
            rows = torch.from_numpy(batch_indices(data.num_train_rows, cfg.batch_size, step,
                                                  steps_per_epoch, seed, rank, world_size))
            batch = to_device(trim_padding({k: v[rows] for k, v in tensors.items()}),
                              engine.device)
            out = engine(**batch)
            engine.backward(out["loss"])
            lr = engine.get_lr()[0]  # the rate this step trains at: its scheduler moves on in it
            engine.step()
            loss_sum += out["loss"].detach()
            window_steps += 1
            window_rows += len(rows)
            if step == 0 or (step + 1) % log_every == 0 or step + 1 == num_steps:
                sums = torch.stack([loss_sum, loss_sum.new_tensor(float(window_steps)),
                                    loss_sum.new_tensor(float(window_rows))])
                loss, micro_steps, examples = all_reduce_sum(sums, engine.device).tolist()
                seconds = max(time.time() - window_start, 1e-9)
                last_loss = loss / micro_steps
                logger.log(step + 1, {"loss": last_loss, "lr": lr,
                                      "seq_per_s": examples / seconds})
                loss_sum.zero_()
                window_steps = window_rows = 0
                survivors.freeze()
                window_start = time.time()  # the freeze's own collection is no training time
    logger.close()
    return last_loss


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch cut to its longest row: features are padded to max_seq_length (SST-2's
    sentences average ~25 of 128 tokens) and padding is masked anyway, so the numbers are the
    same for ~1/5 of the work. Read on the host before the copy: no device sync."""
    width = int(batch["attention_mask"].sum(dim=1).max())
    return {k: v[:, :width] if v.dim() == 2 and k in MODEL_INPUTS else v
            for k, v in batch.items()}


def _pad_to(logits: torch.Tensor, width: int) -> torch.Tensor:
    """[B, w] token logits (SQuAD) padded back to [B, width] with -inf, never chosen."""
    return torch.nn.functional.pad(logits, (0, width - logits.shape[1]), value=float("-inf"))


@torch.no_grad()
def evaluate(engine, data: TaskData, cfg: FinetuneConfig) -> tuple[dict[str, float], Any]:
    """Dev metrics and predictions: class ids or scores per example, or SQuAD's {id: answer
    text}; on rank 0 (the others get ({}, None)). Each rank runs a contiguous share of rows."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = engine.module  # whole parameters under ZeRO 0-2; no collective per batch
    module.eval()
    num_rows = data.dev["input_ids"].shape[0]
    bounds = np.linspace(0, num_rows, world_size + 1).astype(int)
    outputs = []
    for start in range(bounds[rank], bounds[rank + 1], cfg.eval_batch_size):
        stop = min(start + cfg.eval_batch_size, bounds[rank + 1])
        batch = trim_padding({k: data.dev[k][start:stop] for k in MODEL_INPUTS})
        out = module(**to_device(batch, engine.device))
        width = data.dev["input_ids"].shape[1]  # SQuAD's logits back to the features' width
        outputs.append({k: (_pad_to(v.float().cpu(), width) if k in SPAN_LOGITS
                            else v.float().cpu()).numpy() for k, v in out.items()
                        if k != "loss"})
    module.train()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, outputs)  # rank order: the dev rows in order
    if rank != 0:
        return {}, None
    parts = [output for part in gathered for output in part]
    logits = {k: np.concatenate([output[k] for output in parts]) for k in parts[0]}
    return _score(data, cfg, logits)


def _score(data: TaskData, cfg: FinetuneConfig, logits: dict[str, np.ndarray]):
    """(metrics, predictions); ({}, None) when a logit is NaN (a diverged model), where argmax
    would have answered class 0 for every example without a word."""
    from bertforge.training.finetune.metrics import squad_evaluate, task_metrics

    if any(np.isnan(values).any() for values in logits.values()):
        return {}, None

    if data.spec is None:
        from bertforge.training.finetune.squad import postprocess_predictions

        answers = postprocess_predictions(
            data.dev_examples, data.dev, logits["start_logits"], logits["end_logits"],
            max_answer_length=cfg.max_answer_length,
        )
        return squad_evaluate(data.dev_examples, answers), answers
    if data.spec.is_regression:
        predictions = logits["logits"][:, 0]
    else:
        predictions = logits["logits"].argmax(axis=-1)
    labels = data.dev["labels"].numpy()
    return task_metrics(data.spec, predictions, labels), predictions


def _against_chance(data: TaskData, predictions) -> dict[str, Any]:
    """A classification run's bar and whether it cleared it: `chance`, what always answering
    the dev set's most frequent label scores, and `single_label`, the label it gave every dev
    example where it gave one only (it learned nothing). {} for SQuAD, a regression, or a
    diverged run."""
    from bertforge.training.finetune.metrics import chance_level, single_label

    if data.spec is None or data.spec.is_regression or predictions is None:
        return {}
    names = data.spec.exported_labels
    chance = chance_level(data.spec, data.dev["labels"].numpy())
    only = single_label(predictions)
    return {"chance": {"label": names[chance["label"]], "metrics": chance["metrics"]},
            "single_label": None if only is None else names[only]}


def _write_outputs(model, cfg: FinetuneConfig, data: TaskData, pretrained,
                   predictions) -> dict[str, str]:
    """Dev predictions and the Hugging Face export, in cfg.output; their paths."""
    os.makedirs(cfg.output, exist_ok=True)
    if data.spec is None:
        predictions_path = os.path.join(cfg.output, "dev_predictions.json")
        _write_json(predictions_path, predictions)  # the official {id: answer} format
    else:
        predictions_path = os.path.join(cfg.output, "dev_predictions.tsv")
        write_glue_predictions(predictions_path, data, predictions)
    # Positions past both the pretraining's and this fine-tuning's length never trained: the
    # export's tokenizer stops before them, and a fine-tune from it warns (it said 512).
    pretrained_positions = 0 if cfg.random_init else pretrained.provenance.get(
        "positions_trained") or 0
    hf_dir = export_finetuned(
        model, pretrained.vocab_path, pretrained.lower_case,
        os.path.join(cfg.output, HF_DIR_NAME), task=cfg.task, overwrite=True,
        labels=None if data.spec is None else data.spec.exported_labels,
        positions_trained=max(pretrained_positions, cfg.seq_length),
    )
    return {"predictions": predictions_path, "hf_dir": hf_dir}


def write_glue_predictions(path: str, data: TaskData, predictions: np.ndarray) -> None:
    """line (in the dev file), prediction, label: the labels named as the export, results.json
    and the console name them (SST-2's `negative`/`positive` for the file's `0`/`1`: a run said
    to predict 'negative' for every example showed `0` here), or scores for a regression."""
    labels = data.spec.exported_labels

    def shown(value) -> str:
        # 9 digits give a float32 score back exactly: at 6, near-equal scores tied in the file,
        # and a Spearman recomputed from it (0.1929) was not the reported one (0.1974).
        return f"{float(value):.9g}" if labels is None else labels[int(value)]

    with open(path, "w", encoding="utf-8") as f:
        f.write("line\tprediction\tlabel\n")
        for example, prediction in zip(data.dev_examples, predictions, strict=True):
            f.write(f"{example.line}\t{shown(prediction)}\t{shown(example.label)}\n")


def _write_json(path: str, values: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
