"""ZeRO stage defaults that fit the hardware and fp32 gradient accumulation under bf16."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bertforge.training import checkpoint, recipes
from bertforge.training.config import TrainConfig
from bertforge.training.engine import build_engine, deepspeed_config
from bertforge.training.loop import train
from bertforge.training.model import BertConfig, BertForPreTraining
from bertforge.training.resolved_engine import resolve_engine
from tests.training.test_loop import config

BERT_LARGE = 335_000_000
GB = 1e9


def test_bert_large_model_states_take_6_7_gb_per_gpu_unsharded():
    """The module docstring's table: 2 + 2 + 4 + 4 + 8 bytes per parameter under bf16."""
    state = recipes.model_state_bytes(BERT_LARGE, precision="bf16", zero_stage=1, world_size=1)
    assert state / GB == pytest.approx(6.7)
    no_accumulation_buffer = recipes.model_state_bytes(
        BERT_LARGE, precision="bf16", zero_stage=0, world_size=1)
    assert no_accumulation_buffer / GB == pytest.approx(5.36)
    # Stage 1 on 8 GPUs shards the 12 B of master weights and moments: 0.5 GB each.
    sharded = recipes.model_state_bytes(BERT_LARGE, precision="bf16", zero_stage=1, world_size=8)
    assert (state - sharded) / GB == pytest.approx(12 * BERT_LARGE * 7 / 8 / GB)


@pytest.mark.parametrize("world_size, precision, optimizer, expected", [
    (1, "fp32", "adamw", 0),   # DDP-like, nothing to shard
    (1, "bf16", "adamw", 0),   # fp32 weights under torch.autocast: the fused fast path
    (8, "bf16", "adamw", 0),   # the same path: 5.4 GB of model states fit an 80 GB GPU
    (8, "fp32", "adamw", 0),
    (8, "bf16", "lamb", 0),    # LAMB needs whole parameters
])
def test_default_zero_stage_is_0_while_the_model_states_fit(world_size, precision, optimizer,
                                                             expected):
    stage = recipes.default_zero_stage(
        world_size=world_size, precision=precision, optimizer=optimizer,
        num_parameters=BERT_LARGE, device_memory_bytes=80 * 2**30,
    )
    assert stage == expected


def test_zero_1_2_and_3_only_when_the_model_states_do_not_fit():
    def stage(num_parameters: int, world_size: int = 8, memory_gb: float = 80) -> int:
        return recipes.default_zero_stage(
            world_size=world_size, precision="bf16", num_parameters=num_parameters,
            device_memory_bytes=int(memory_gb * 2**30))

    assert stage(BERT_LARGE, memory_gb=16) == 0  # 5.4 GB of 8
    # 3B parameters x 16 B = 48 GB > 40 GB at stage 0; x (8 + 12/8) B = 28.5 GB fits.
    assert stage(3_000_000_000) == 1
    # 5B parameters x (8 + 12/8) B = 47.5 GB > 40 GB; x (2 + 18/8) B = 21 GB fits.
    assert stage(5_000_000_000) == 2
    assert stage(20_000_000_000) == 3  # x (2 + 18/8) B = 85 GB > 40 GB
    assert stage(20_000_000_000, world_size=1) == 0  # one rank: sharding saves nothing
    # Unknown device memory (a CPU): no escalation.
    assert recipes.default_zero_stage(world_size=8, precision="bf16",
                                      num_parameters=10**12) == 0


def test_full_size_recipes_leave_the_stage_to_the_hardware_and_small_ones_keep_theirs():
    assert recipes.bert_large_phase1("d", "r").zero_stage is None
    assert recipes.bert_base_phase2("d", "r", init_from="x").zero_stage is None
    assert recipes.bert_large_phase1("d", "r", zero_stage=2).zero_stage == 2  # override
    assert recipes.bert_tiny_phase1("d", "r").zero_stage == 0
    assert recipes.demo_recipe("d", "r").zero_stage == 2
    assert TrainConfig(data_dir="d", run_dir="r").zero_stage is None


def test_resolution_keeps_an_explicit_stage_and_a_resumed_run_s_own():
    def stage(cfg: TrainConfig, world_size: int, saved: dict | None = None) -> int:
        return resolve_engine(cfg.engine(), world_size, saved=saved).config.zero_stage

    auto = TrainConfig(data_dir="d", run_dir="r", precision="bf16")
    assert stage(auto, 1) == stage(auto, 4) == 0
    fp32 = TrainConfig(data_dir="d", run_dir="r", precision="fp32")
    assert stage(fp32, 1) == 0
    # A run saved under stage 1 (the default on several ranks before 2026-11-27) keeps it.
    assert stage(fp32, 4, saved={"zero_stage": 1, "precision": "fp32"}) == 1
    explicit = TrainConfig(data_dir="d", run_dir="r", zero_stage=3)
    assert stage(explicit, 1, saved={"zero_stage": 1}) == 3
    lamb = TrainConfig(data_dir="d", run_dir="r", optimizer="lamb")
    assert stage(lamb, 8) == 0
    with pytest.raises(ValueError, match="lamb"):
        TrainConfig(data_dir="d", run_dir="r", optimizer="lamb", zero_stage=1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_accumulates_gradients_in_fp32_where_deepspeed_can(stage):
    bf16 = dict(data_dir="d", run_dir="r", zero_stage=stage, precision="bf16")
    ds = deepspeed_config(resolve_engine(TrainConfig(**bf16).engine(), 2))
    if stage == 0:  # fp32 weights and gradients, the forward under torch.autocast
        assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
        assert "data_types" not in ds and "bf16" not in ds
        assert ds["gradient_clipping"] == 0.0  # ClippedAdamW clips, in multi-tensor kernels
    else:
        assert "torch_autocast" not in ds and ds["gradient_clipping"] == 1.0
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["zero_optimization"].get("overlap_comm", False) == (stage in (1, 2))
    fp32 = deepspeed_config(resolve_engine(TrainConfig(
        data_dir="d", run_dir="r", zero_stage=stage, precision="fp32").engine(), 2))
    assert "data_types" not in fp32  # the model dtype is fp32 already
    one_rank = deepspeed_config(resolve_engine(TrainConfig(**bf16).engine(), 1))
    assert "overlap_comm" not in one_rank["zero_optimization"]  # nothing to overlap


def test_default_config_on_one_and_on_eight_ranks():
    cfg = TrainConfig(data_dir="d", run_dir="r", micro_batch_size=8, global_batch_size=64,
                      precision="bf16")
    one, eight = (deepspeed_config(resolve_engine(cfg.engine(), n)) for n in (1, 8))
    assert one["zero_optimization"] == {"stage": 0}
    assert one["torch_autocast"]["enabled"] and "data_types" not in one
    # Eight ranks take the same fast path; the fp32 gradients are all-reduced during the
    # backward (training.gradient_buckets), not by DeepSpeed.
    assert eight["zero_optimization"] == {"stage": 0}
    assert eight["torch_autocast"]["enabled"] and "data_types" not in eight
    assert "communication_data_type" not in eight  # fp32: DeepSpeed's default without "bf16"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_under_zero_deepspeed_gets_an_optimizer_it_knows_and_says_nothing(stage, capfd):
    """Under ZeRO DeepSpeed clips and hands the optimizer its fp32 partitions: torch's fused
    AdamW, the exact type ZeRO lists as tested. A subclass of it drew "You are using ZeRO with
    an untested optimizer" onto the console (seen in the H200 parity run of 2026-11-27)."""
    from bertforge.training.engine import ensure_process_group

    ensure_process_group()
    cfg = TrainConfig(data_dir="d", run_dir="r", zero_stage=stage, precision="bf16",
                      micro_batch_size=4, max_steps=4, warmup_steps=0)
    capfd.readouterr()
    engine = build_engine(BertForPreTraining(BertConfig(64, 32, 1, 2, 64)),
                          resolve_engine(cfg.engine(), 1))
    assert type(engine.basic_optimizer) is torch.optim.AdamW
    assert engine.basic_optimizer.defaults["fused"] is True
    out, err = capfd.readouterr()
    assert "untested optimizer" not in out + err


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_engine_accumulates_the_mean_gradient_in_fp32_and_trains(stage):
    """The built engine: DeepSpeed's data types and buffers say fp32 accumulation; after two
    micro-batches it holds their mean gradient (an fp32 model's, up to bf16 rounding), not
    the first counted twice; and a few optimizer steps lower the loss of a fixed batch."""
    from deepspeed.utils import safe_get_full_grad

    from bertforge.training.engine import ensure_process_group
    from tests.training.test_model import random_batch

    ensure_process_group()
    model_config = BertConfig(64, 32, 1, 2, 64, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
    cfg = TrainConfig(data_dir="d", run_dir="r", zero_stage=stage, precision="bf16",
                      micro_batch_size=4,
                      gradient_accumulation_steps=2, learning_rate=1e-2, warmup_steps=0,
                      max_steps=4, gradient_clipping=0.0)
    torch.manual_seed(0)
    reference = BertForPreTraining(model_config)
    torch.manual_seed(0)
    engine = build_engine(BertForPreTraining(model_config), resolve_engine(cfg.engine(), 1))
    if stage == 0:  # fp32 weights and gradients; the forward runs under bf16 autocast
        assert engine.get_data_types() == (torch.float32, torch.float32)
        assert engine.torch_autocast_enabled()
        assert engine.torch_autocast_dtype() == torch.bfloat16
    else:
        assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    if stage == 1:
        assert type(engine.optimizer).__name__ == "BF16_Optimizer"
        assert all(buffer.dtype == torch.float32
                   for buffer in engine.optimizer.fp32_groups_gradients_flat)
    elif stage >= 2:
        assert engine.optimizer.gradient_accumulation_dtype == torch.float32

    micro_batches = [random_batch(model_config, batch_size=4, seq_len=12, seed=s) for s in (0, 1)]
    parameters = list(reference.parameters())
    per_batch = [torch.autograd.grad(reference(**b).loss, parameters) for b in micro_batches]
    for batch in micro_batches:
        engine.backward(engine(**batch).loss)
    for (name, param), g0, g1 in zip(engine.module.named_parameters(), *per_batch, strict=True):
        mean, accumulated = (g0 + g1) / 2, safe_get_full_grad(param).float()
        assert accumulated.dtype == torch.float32
        assert (accumulated - mean).norm() <= 0.05 * mean.norm() + 1e-6, name
    engine.step()

    batch = micro_batches[0]
    losses = []
    for _ in range(6):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_the_stage_decided_at_start_is_recorded_and_a_resume_keeps_its_own(tmp_path):
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "data"), {"train": [48]}, max_seq_length=64)
    auto = train(config(data, tmp_path / "auto", zero_stage=None, max_steps=2))
    with open(os.path.join(tmp_path / "auto", "config.json")) as f:
        assert json.load(f)["train"]["zero_stage"] == 0  # bf16 on one worker
    assert checkpoint.read_metadata(auto.checkpoint_path)["zero_stage"] == 0
    # Saved under an explicit stage 2, resumed with none named: it stays at 2 (its optimizer
    # state is laid out for stage 2), not the default 0.
    train(config(data, tmp_path / "two", zero_stage=2, max_steps=2))
    resumed = train(config(data, tmp_path / "two", zero_stage=None, max_steps=3))
    assert resumed.global_step == 3
    assert checkpoint.read_metadata(resumed.checkpoint_path)["zero_stage"] == 2


def test_deepspeed_does_not_compile_its_inference_shm_op_for_training(tmp_path, capfd):
    """DeepSpeed's comm backend would JIT-compile `deepspeed_shm_comm` (a minute of a fresh
    2-core machine's CPU, rebuilt when the ninja version changes) for an op only tensor-parallel
    inference uses; the engine is built without it, and without its console line."""
    import deepspeed.comm.comm as ds_comm

    from bertforge.training.engine import ensure_process_group

    ensure_process_group()  # as the training and fine-tuning loops do first
    model = BertForPreTraining(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32))
    cfg = TrainConfig(data_dir=str(tmp_path), run_dir=str(tmp_path), precision="fp32",
                      zero_stage=2, micro_batch_size=2, max_steps=1)
    engine = build_engine(model, resolve_engine(cfg.engine(), 1))
    assert engine.zero_optimization_stage() == 2
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert "shm_comm_op built successfully" not in capfd.readouterr().out
