"""The loop's log interval (`loop._Window`): an evaluation or a checkpoint inside it is left out
of its time, and the steps before it stay both counted and timed.

Restarting the clock after an evaluation kept the sequences of the steps before it but dropped
their time: throughput, TFLOP/s and MFU up to 2x too high in every interval holding an eval. A
clock of the test's own makes the arithmetic exact (no timing is measured here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bertforge.training import loop
from bertforge.training.model import IGNORE_INDEX, BertConfig


def _micro_batch(rows: int = 4, width: int = 8) -> tuple[SimpleNamespace, dict]:
    loss = torch.tensor(2.0)
    out = SimpleNamespace(loss=loss, mlm_loss=loss - 1, nsp_loss=loss - 1)
    labels = torch.full((rows, width), IGNORE_INDEX)
    labels[:, 1] = 5
    batch = {"input_ids": torch.ones(rows, width, dtype=torch.long),
             "attention_mask": torch.ones(rows, width, dtype=torch.long),
             "next_sentence_label": torch.zeros(rows, dtype=torch.long), "labels": labels}
    return out, batch


@pytest.mark.parametrize("left_out_seconds", [0.0, 100.0])
def test_an_evaluation_inside_the_interval_is_left_out_of_its_time(monkeypatch,
                                                                    left_out_seconds):
    clock = [1000.0]
    monkeypatch.setattr(loop.time, "time", lambda: clock[0])
    window = loop._Window(BertConfig.preset("tiny", vocab_size=64), peak_tflops=None,
                          world_size=1, device=torch.device("cpu"), max_predictions=4)
    for _ in range(2):  # two steps, 10 s
        window.add(*_micro_batch())
    clock[0] += 10.0

    def evaluation() -> dict:
        clock[0] += left_out_seconds
        return {"eval_loss": 1.0}

    assert window.left_out(evaluation) == {"eval_loss": 1.0}
    for _ in range(2):  # two more steps, 10 s
        window.add(*_micro_batch())
    clock[0] += 10.0
    metrics, save_due = window.reduce(lr=1e-4)
    # 16 sequences of 8 real tokens in the 20 s the four steps took, whatever the eval took.
    assert metrics["seq_per_s"] == pytest.approx(16 / 20)
    assert metrics["tokens_per_s"] == pytest.approx(16 * 8 / 20)
    assert metrics["lr"] == 1e-4 and metrics["loss"] == pytest.approx(2.0)
    assert save_due is False  # no rank voted for a save
