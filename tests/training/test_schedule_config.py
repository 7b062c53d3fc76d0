import pytest

from training.config import TrainConfig
from training.engine import deepspeed_config
from training.flops import training_flops_per_sequence
from training.schedule import lr_multiplier


def test_warmup_rises_linearly_to_peak_then_decays_to_zero():
    factors = [lr_multiplier(s, warmup_steps=10, max_steps=110) for s in range(111)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.5)
    assert factors[110] == 0.0
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))


def test_polynomial_decay_uses_the_power():
    linear = lr_multiplier(60, warmup_steps=10, max_steps=110)
    squared = lr_multiplier(60, warmup_steps=10, max_steps=110, decay="polynomial", power=2.0)
    assert squared == pytest.approx(linear**2)


def test_no_warmup_starts_at_peak():
    assert lr_multiplier(0, warmup_steps=0, max_steps=10) == 1.0


@pytest.mark.parametrize(
    "field, value",
    [("precision", "fp8"), ("zero_stage", 4), ("max_steps", 0), ("warmup_steps", 2000),
     ("learning_rate", 0.0), ("mask_prob", 1.5), ("decay", "cosine")],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        TrainConfig(data_dir="d", run_dir="r", **{field: value})


def test_config_round_trips_and_rejects_unknown_keys():
    cfg = TrainConfig(data_dir="d", run_dir="r", max_steps=50, warmup_steps=5)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown training config keys"):
        TrainConfig.from_dict({**cfg.to_dict(), "learning_rat": 1})


def test_deepspeed_config_batch_arithmetic_and_precision():
    cfg = TrainConfig(data_dir="d", run_dir="r", micro_batch_size=16,
                      gradient_accumulation_steps=4, zero_stage=3, precision="bf16")
    ds = deepspeed_config(cfg, world_size=8)
    # 16 micro x 4 accumulation x 8 ranks = 512 sequences per optimizer step
    assert ds["train_batch_size"] == 512
    assert ds["train_micro_batch_size_per_gpu"] == 16
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    fp16 = deepspeed_config(TrainConfig(data_dir="d", run_dir="r", precision="fp16"), 1)
    assert fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    fp32 = deepspeed_config(TrainConfig(data_dir="d", run_dir="r", precision="fp32"), 1)
    assert "bf16" not in fp32 and "fp16" not in fp32


def test_bert_large_costs_about_1_9_gflop_per_token_at_128():
    flops = training_flops_per_sequence(
        num_layers=24, hidden_size=1024, intermediate_size=4096, vocab_size=30522,
        seq_len=128, num_predictions=20,
    )
    assert 1.8e9 < flops / 128 < 1.95e9
