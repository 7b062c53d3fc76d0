import pytest

from bertforge.training import resolved_engine
from bertforge.training.config import TrainConfig
from bertforge.training.engine import deepspeed_config
from bertforge.training.errors import UserInputError
from bertforge.training.flops import mfu, training_flops_per_batch, training_flops_per_sequence
from bertforge.training.resolved_engine import resolve_engine
from bertforge.training.schedule import lr_multiplier


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


def test_deepspeed_config_batch_arithmetic_and_precision(monkeypatch):
    cfg = TrainConfig(data_dir="d", run_dir="r", micro_batch_size=16,
                      gradient_accumulation_steps=4, zero_stage=3, precision="bf16")
    ds = deepspeed_config(resolve_engine(cfg.engine(), 8))
    # 16 micro x 4 accumulation x 8 ranks = 512 sequences per optimizer step
    assert ds["train_batch_size"] == 512
    assert ds["train_micro_batch_size_per_gpu"] == 16
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    monkeypatch.setattr(resolved_engine, "check_precision_supported", lambda precision: None)
    fp16 = deepspeed_config(resolve_engine(
        TrainConfig(data_dir="d", run_dir="r", precision="fp16").engine(), 1))
    assert fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    fp32 = deepspeed_config(resolve_engine(
        TrainConfig(data_dir="d", run_dir="r", precision="fp32").engine(), 1))
    assert "bf16" not in fp32 and "fp16" not in fp32


def test_bert_large_costs_about_1_9_gflop_per_token_at_128():
    flops = training_flops_per_sequence(
        num_layers=24, hidden_size=1024, intermediate_size=4096, vocab_size=30522,
        seq_len=128, num_predictions=20,
    )
    assert 1.8e9 < flops / 128 < 1.95e9


def test_global_batch_size_derives_accumulation_from_the_world_size():
    cfg = TrainConfig(data_dir="d", run_dir="r", micro_batch_size=16, global_batch_size=512)
    # 512 = 16 micro x 4 accumulation x 8 ranks = 16 x 32 x 1 rank
    assert cfg.accumulation_steps(8) == 4 and cfg.accumulation_steps(1) == 32
    assert cfg.global_batch(8) == cfg.global_batch(1) == 512
    ds = deepspeed_config(resolve_engine(cfg.engine(), 8))
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (512, 4)


def test_global_batch_size_that_does_not_divide_is_a_clear_error():
    cfg = TrainConfig(data_dir="d", run_dir="r", micro_batch_size=16, global_batch_size=512)
    with pytest.raises(UserInputError,
                       match=r"global_batch_size 512 is not a multiple of .* 16 x 3"):
        cfg.accumulation_steps(3)
    with pytest.raises(ValueError, match="global_batch_size"):
        TrainConfig(data_dir="d", run_dir="r", global_batch_size=0)


def test_without_global_batch_size_accumulation_is_the_recipe_s():
    cfg = TrainConfig(data_dir="d", run_dir="r", micro_batch_size=8, gradient_accumulation_steps=3)
    assert cfg.accumulation_steps(5) == 3 and cfg.global_batch(5) == 120


def test_fp16_on_a_cpu_without_fp16_kernels_is_a_clear_error(monkeypatch):
    class CpuWithoutFp16:
        def device_name(self):
            return "cpu"

        def is_fp16_supported(self):
            return False

    monkeypatch.setattr(resolved_engine, "get_accelerator", CpuWithoutFp16)
    with pytest.raises(ValueError, match="fp16 needs a GPU.*--precision auto"):
        resolve_engine(TrainConfig(data_dir="d", run_dir="r", precision="fp16").engine(), 1)


def test_batch_flops_count_the_padded_width_and_the_real_predictions():
    shape = dict(num_layers=12, hidden_size=768, intermediate_size=3072, vocab_size=30522)
    one = training_flops_per_sequence(**shape, seq_len=128, num_predictions=19)
    # 8 rows of 128 tokens with 19 predictions each = 8 sequences' worth, exactly.
    assert training_flops_per_batch(**shape, batch_size=8, seq_len=128,
                                    num_predictions=8 * 19) == 8 * one
    # A batch padded only to 64 costs about half (attention makes it a little less).
    half = training_flops_per_batch(**shape, batch_size=8, seq_len=64, num_predictions=8 * 10)
    assert 0.45 < half / (8 * one) < 0.5


def test_mfu_is_total_tflops_over_the_peak_of_all_devices():
    # 8 H100s at 989 TFLOP/s dense bf16 each, achieving 3,560.4 TFLOP/s together: 45 %.
    assert mfu(3560.4, peak_tflops_per_device=989.0, world_size=8) == pytest.approx(0.45)
    assert mfu(100.0, peak_tflops_per_device=200.0, world_size=1) == 0.5
    with pytest.raises(ValueError):
        mfu(1.0, peak_tflops_per_device=0.0, world_size=1)


@pytest.mark.parametrize("field, value", [("peak_tflops", 0.0), ("eval_every", -1)])
def test_config_rejects_bad_eval_and_mfu_settings(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(data_dir="d", run_dir="r", **{field: value})


def test_sparse_last_layer_flops():
    shape = dict(num_layers=12, hidden_size=768, intermediate_size=3072, vocab_size=30522,
                 batch_size=8, seq_len=128, num_predictions=152)
    dense = training_flops_per_batch(**shape)
    assert training_flops_per_batch(**shape, last_layer_rows=128) == dense  # all rows: dense
    h, i, L = 768, 3072, 128
    # The last layer on 20 rows: K, V on all 128 tokens, the rest on 20.
    saved = 3 * 8 * (L - 20) * (4 * h * h + 4 * h * i + 4 * L * h)
    assert training_flops_per_batch(**shape, last_layer_rows=20) == dense - saved
