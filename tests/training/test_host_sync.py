"""No host sync per micro-step (issue 11, item 2).

A GPU step that reads a device value back (`.item()`, `bool(t)`, boolean-mask indexing)
waits there for every queued kernel. Two kinds of proof on the CPU:
- the sparse MLM head and LAMB run on the `meta` device, where any such read raises: what
  runs there reads nothing, by construction (and the head's non-CPU branches are the ones run);
- the real loop runs under a counter of host reads (tests/support/host_sync.py): ours are
  one per log line and one per validation pass, however many micro-steps and batches.
"""

from __future__ import annotations

import os

import pytest
import torch

from bertforge.training import loop
from bertforge.training.config import TrainConfig
from bertforge.training.metrics import read_metrics
from bertforge.training.model import IGNORE_INDEX, BertConfig, BertForPreTraining, output_rows
from bertforge.training.optim import Lamb
from tests.support.host_sync import HostSyncCounter
from tests.training.conftest import write_dataset
from tests.training.test_model import random_batch

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(loop.__file__)))
CONFIG = BertConfig(99, 64, 2, 4, 128)


def test_fixed_width_head_is_the_exact_head_on_the_same_rows():
    """Same logits at the labelled positions, same loss, same gradients as the head that
    computes exactly those positions (which Hugging Face parity holds, test_model.py)."""
    batch = random_batch(CONFIG, batch_size=4, seq_len=20)
    most = int((batch["labels"] != IGNORE_INDEX).sum(dim=1).max())  # 3 here
    torch.manual_seed(0)
    exact = BertForPreTraining(CONFIG).eval()
    fixed = BertForPreTraining(CONFIG).eval()
    fixed.load_state_dict(exact.state_dict())
    fixed.max_predictions = most + 2  # 2 padding slots in every row at least
    out_exact, out_fixed = exact(**batch), fixed(**batch)
    out_exact.loss.backward()
    out_fixed.loss.backward()

    assert out_fixed.prediction_logits.shape == (4, most + 2, CONFIG.vocab_size)
    real = out_fixed.prediction_labels != IGNORE_INDEX
    assert torch.equal(out_fixed.prediction_labels[real], out_exact.prediction_labels)
    assert torch.equal(out_exact.prediction_labels, batch["labels"][batch["labels"] != -100])
    torch.testing.assert_close(out_fixed.prediction_logits[real], out_exact.prediction_logits,
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(out_fixed.loss, out_exact.loss, rtol=0, atol=1e-6)
    for (name, a), b in zip(exact.named_parameters(), fixed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


def test_fixed_width_head_reads_nothing_from_the_device():
    """Forward and backward on `meta`, where `.item()`, `bool()` and boolean indexing raise."""
    batch = {name: tensor.to("meta") for name, tensor in random_batch(CONFIG).items()}
    model = BertForPreTraining(CONFIG).to("meta")  # training mode: dropout on
    model.max_predictions = 6
    out = model(**batch)
    out.loss.backward()
    assert out.prediction_logits.shape == (4, 6, CONFIG.vocab_size)
    assert out.prediction_labels.shape == (4, 6)
    assert model.cls.predictions.transform.dense.weight.grad is not None
    # Narrower than max_predictions: a batch padded to 5 tokens has at most 5 labels a row.
    narrow = {name: t[:, :5] if t.dim() == 2 else t for name, t in batch.items()}
    assert model(**narrow).prediction_logits.shape == (4, 5, CONFIG.vocab_size)


def test_more_labels_in_a_row_than_max_predictions_is_an_error():
    labels = torch.full((2, 8), IGNORE_INDEX)
    labels[1, 2:6] = 7  # 4 labels in row 1
    rows, targets = output_rows(labels, 4)
    assert rows.tolist() == [[0, 0, 0, 0, 0], [0, 2, 3, 4, 5]]
    assert targets.tolist() == [[-100] * 4, [7] * 4]
    with pytest.raises(RuntimeError, match="more than max_predictions=3"):
        output_rows(labels, 3)


def test_lamb_step_reads_nothing_from_the_device():
    weight = torch.nn.Parameter(torch.ones(4, 3, device="meta"))
    bias = torch.nn.Parameter(torch.ones(3, device="meta"))
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    optimizer = Lamb([{"params": [weight], "weight_decay": 0.01},
                      {"params": [bias], "weight_decay": 0.0}], lr=0.1)
    optimizer.step()
    optimizer.step()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [70, 60], "validation": [40]}, max_seq_length=64)


def test_the_loop_reads_the_device_once_per_log_line_and_validation_pass(dataset, tmp_path):
    # 6 steps x 2 micro-batches, logs at steps 1, 3, 6; validation of 3 batches at 3 and 6.
    # LAMB at ZeRO 0 so that the optimizer is ours too.
    cfg = TrainConfig(
        data_dir=dataset, run_dir=str(tmp_path / "run"), max_steps=6, micro_batch_size=4,
        gradient_accumulation_steps=2, warmup_steps=1, learning_rate=1e-3, log_every=3,
        eval_every=3, eval_batches=3, zero_stage=0, precision="fp32", optimizer="lamb",
        model={"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2,
               "intermediate_size": 64},
    )
    counter = HostSyncCounter(PACKAGE_ROOT)
    with counter:
        loop.train(cfg)
    records = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records if "loss" in r] == [1, 3, 6]
    assert [r["step"] for r in records if "eval_mlm_accuracy" in r] == [3, 6]
    ours = {site: count for site, count in counter.sites.items()
            if site.startswith(("training/", "cluster/"))}
    # Whether a CPU batch is padded at all (no mask then): a check made on a CPU only, where
    # nothing waits; on a GPU the mask is kept and nothing is read.
    ours.pop("training/model.py:key_padding_mask", None)
    assert ours == {"training/loop.py:reduce": 3, "training/evaluate.py:evaluate": 2}


@pytest.mark.parametrize("stage", [0, 1])
def test_the_engine_never_synchronizes_the_device_in_a_step(stage, monkeypatch):
    """DeepSpeed's throughput timer, on by default, synchronizes the device when a forward
    starts and when a step ends (twice a micro-step from the third): on a GPU the host would
    wait for the queue to drain and launch nothing ahead. The engine turns it off; counted
    here through the accelerator's `synchronize`, which DeepSpeed calls for it (a no-op on a
    CPU, counted all the same: 8 calls in these 6 steps with the timer on)."""
    from deepspeed.accelerator import get_accelerator

    from bertforge.training.engine import build_engine, ensure_process_group
    from bertforge.training.resolved_engine import resolve_engine
    from tests.support.synthetic import synthetic_batches

    ensure_process_group()
    torch.manual_seed(0)
    model = BertForPreTraining(CONFIG)
    model.max_predictions = 20
    cfg = TrainConfig(data_dir="d", run_dir="r", precision="fp32", micro_batch_size=4,
                      max_steps=10, warmup_steps=2, compile=False, zero_stage=stage)
    engine = build_engine(model, resolve_engine(cfg.engine(), 1))
    accelerator = get_accelerator()
    calls = []
    synchronize = accelerator.synchronize
    monkeypatch.setattr(accelerator, "synchronize",
                        lambda *args, **kwargs: (calls.append(1), synchronize(*args, **kwargs)))
    for batch in synthetic_batches(6, 4, 32, CONFIG.vocab_size, seed=1):
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
    monkeypatch.undo()
    engine.destroy()
    assert calls == []
