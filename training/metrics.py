"""Run metrics: a progress line, `metrics.jsonl` and TensorBoard events in the run directory."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

METRICS_NAME = "metrics.jsonl"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """"1 worker", "2 workers" ("1 batch", "3 batches" with `plural`): console lines read as
    sentences."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


class MetricsLogger:
    """Rank 0 writes; on other ranks it does nothing. It keeps no record in memory: a run of
    weeks logs for as long, and every record it kept (~0.5 KB each, on every rank, never read)
    grew its workers by half a GB a million log lines."""

    def __init__(self, run_dir: str, *, enabled: bool, max_steps: int,
                 prefix: str = "train", resumed_step: int | None = None) -> None:
        """`resumed_step`: the run continues from a checkpoint at that step; what an earlier
        process logged after it (the steps it trained but never saved) is dropped first, from
        metrics.jsonl and TensorBoard alike, so every step is in them once."""
        self.enabled = enabled
        self.prefix = prefix  # the progress line's tag: [train], [finetune]
        self.max_steps = max_steps
        self._start = time.time()
        self._writer = None
        self._file = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            if resumed_step is not None:
                _drop_after(os.path.join(run_dir, METRICS_NAME), resumed_step)
            self._file = open(os.path.join(run_dir, METRICS_NAME), "a", encoding="utf-8")
            if _ends_mid_line(os.path.join(run_dir, METRICS_NAME)):
                self._file.write("\n")  # a torn record keeps a line of its own, not ours too
            self._writer = _tensorboard_writer(
                os.path.join(run_dir, "tensorboard"),
                purge_step=None if resumed_step is None else resumed_step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(name, value, step)
        console(self._progress_line(step, metrics))

    def _progress_line(self, step: int, metrics: dict[str, Any]) -> str:
        elapsed = time.time() - self._start
        parts = [f"step {step}/{self.max_steps}", f"{elapsed:6.1f}s"]
        shown_names = ("loss", "mlm_loss", "nsp_loss", "lr", "seq_per_s", "tokens_per_s", "tflops",
                       "mfu", "eval_mlm_accuracy", "eval_nsp_accuracy", "eval_mlm_loss")
        for name in shown_names:
            if name in metrics:
                value = metrics[name]
                shown = f"{value:.4g}" if isinstance(value, float) else str(value)
                parts.append(f"{name} {shown}")
        return f"[{self.prefix}] " + " | ".join(parts)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


def console(line: str) -> None:
    """A progress line on stdout, written directly rather than with print(): Ray Train V2
    reroutes print() on its workers through a logger that reaches the driver twice."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, METRICS_NAME)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [record for line in f if (record := _record(line)) is not None]


def _record(line: str) -> dict[str, Any] | None:
    """A line's record; None for a blank line or a torn one: the tail of a record whose write
    a full disk, or a power loss, cut (every resume failed on it with a JSON error)."""
    try:
        record = json.loads(line) if line.strip() else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _ends_mid_line(path: str) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _drop_after(path: str, step: int) -> None:
    """Keep the records of steps up to `step`; rewritten aside and renamed into place."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line if line.endswith("\n") else line + "\n" for line in lines
            if (record := _record(line)) is not None and record.get("step", 0) <= step]
    if len(kept) == len(lines):
        return
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def _tensorboard_writer(log_dir: str, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency, but a metrics file alone still works
        return None
    # purge_step: TensorBoard hides the events of that step and later that an earlier writer
    # of this directory wrote.
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step)
