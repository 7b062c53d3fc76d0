"""The loop through the real DeepSpeed engine on the CPU for every ZeRO stage and precision."""

import math

import pytest
import torch

from bertforge.training import checkpoint
from bertforge.training.loop import train
from bertforge.training.metrics import read_metrics
from bertforge.training.model import BertConfig, BertForPreTraining
from tests.training.test_loop import TINY, config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tests.training.conftest import write_dataset

    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [70, 60], "validation": [40]}, max_seq_length=64)


@pytest.mark.parametrize("stage, precision", [
    (0, "fp32"), (0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"),
])
def test_every_zero_stage_trains_evaluates_and_checkpoints_full_weights(
    dataset, tmp_path, stage, precision
):
    run = train(config(dataset, tmp_path / "run", zero_stage=stage, precision=precision,
                       max_steps=6, learning_rate=3e-3, eval_every=3, eval_batches=2,
                       peak_tflops=1.0))
    records = read_metrics(str(tmp_path / "run"))
    train_records = [r for r in records if "loss" in r]
    losses = [r["loss"] for r in train_records]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2])  # decreasing-ish: six steps of a tiny model
    assert all(r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"]) for r in train_records)

    evals = [r for r in records if "eval_mlm_accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert 0 <= r["eval_mlm_accuracy"] <= 1 and 0 <= r["eval_nsp_accuracy"] <= 1
        assert math.isfinite(r["eval_mlm_loss"]) and math.isfinite(r["eval_nsp_loss"])

    # Full fp32 weights from any stage; ZeRO-3 partitions them, zero_to_fp32 reassembles.
    state = checkpoint.load_fp32_state_dict(run.checkpoint_path)
    reference = BertForPreTraining(BertConfig(**checkpoint.read_metadata(
        run.checkpoint_path)["model_config"])).state_dict()
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
    model, _ = checkpoint.load_model(run.checkpoint_path)  # strict: every parameter present
    if precision == "fp32":
        assert all(torch.equal(state[n], p) for n, p in model.state_dict().items() if n in state)


def test_lamb_and_activation_checkpointing_train_at_stage_0(dataset, tmp_path):
    run = train(config(dataset, tmp_path / "run", zero_stage=0, precision="bf16",
                       optimizer="lamb", activation_checkpointing=True, max_steps=6,
                       learning_rate=3e-3))
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "run"))]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-2:]) < sum(losses[:2])
    assert run.global_step == 6


def test_activation_checkpointing_keeps_the_loss_curve(dataset, tmp_path):
    # fp32 and no dropout: the recomputation must not change a single number.
    model = {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    common = dict(zero_stage=0, precision="fp32", max_steps=3, model=model)
    train(config(dataset, tmp_path / "plain", **common))
    train(config(dataset, tmp_path / "recomputed", activation_checkpointing=True, **common))
    plain = [r["loss"] for r in read_metrics(str(tmp_path / "plain"))]
    recomputed = [r["loss"] for r in read_metrics(str(tmp_path / "recomputed"))]
    assert plain == recomputed
