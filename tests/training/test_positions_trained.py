"""A model pretrained at 128 tokens only (phase 1 without phase 2) has position embeddings
128-511 still at their random initial values. Its export's tokenizer says so (model_max_length),
warm starts and resumes carry what was trained, and a fine-tune longer than that warns."""

from __future__ import annotations

import json

import pytest
import transformers

from bertforge.cluster.commands.finetune_sweep import check_inputs
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.training import checkpoint
from bertforge.training.config import TrainConfig
from bertforge.training.export import export_checkpoint
from bertforge.training.finetune.config import FinetuneConfig
from bertforge.training.loop import train
from tests.support.finetune_data import write_sst2_tsv
from tests.training.conftest import write_dataset

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 128}


def run(data_dir, run_dir, **overrides):
    values = dict(data_dir=data_dir, run_dir=str(run_dir), model=TINY, max_steps=1,
                  micro_batch_size=8, warmup_steps=0, zero_stage=0, precision="fp32")
    return train(TrainConfig(**{**values, **overrides}))


@pytest.fixture(scope="module")
def short_and_long(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    short = write_dataset(str(root / "32"), {"train": [16]}, max_seq_length=32)
    long = write_dataset(str(root / "64"), {"train": [16]}, max_seq_length=64)
    return short, long


def test_positions_trained_follow_the_runs_and_their_warm_starts(short_and_long, tmp_path):
    short, long = short_and_long
    phase1 = run(short, tmp_path / "phase1")
    assert checkpoint.read_metadata(phase1.checkpoint_path)["positions_trained"] == 32
    phase2 = run(long, tmp_path / "phase2", init_from=str(tmp_path / "phase1"))
    assert checkpoint.read_metadata(phase2.checkpoint_path)["positions_trained"] == 64
    # Back to 32 tokens from the 64 one (or resumed): what was trained stays trained.
    again = run(short, tmp_path / "again", init_from=str(tmp_path / "phase2"))
    assert checkpoint.read_metadata(again.checkpoint_path)["positions_trained"] == 64
    resumed = run(short, tmp_path / "again", max_steps=2)
    assert checkpoint.read_metadata(resumed.checkpoint_path)["positions_trained"] == 64
    # A checkpoint saved before this was recorded claims nothing: all its positions.
    assert checkpoint.positions_trained(
        {"model_config": {"max_position_embeddings": 128}}) == 128


def test_the_export_truncates_where_training_did_and_a_longer_fine_tune_warns(
        short_and_long, tmp_path, capsys):
    short, _ = short_and_long
    run(short, tmp_path / "phase1")
    hf_dir = export_checkpoint(str(tmp_path / "phase1"), str(tmp_path / "hf"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.model_max_length == 32
    with open(f"{hf_dir}/config.json", encoding="utf-8") as f:
        assert json.load(f)["max_position_embeddings"] == 128  # the model is unchanged

    tsv = write_sst2_tsv(str(tmp_path / "sst2.tsv"), 40, seed=0)
    warning = ("[finetune] warning: max_seq_length 64 is longer than the 32 tokens {} was "
               "pretrained at: positions 33-64 keep their random initial embeddings; pretrain "
               "a phase at that length first (the pipeline's [phase2]), or give "
               "--max-seq-length 32")
    for model in (str(tmp_path / "phase1"), hf_dir):  # the checkpoint, and its export
        capsys.readouterr()
        for length in (32, 64):
            cfg = FinetuneConfig(task="sst2", model=model, output=str(tmp_path / "ft"),
                                 train=tsv, dev=tsv, max_seq_length=length, batch_size=8)
            facts = check_inputs(cfg, LaunchConfig(workers=1))
            assert facts["model"]["positions_trained"] == 32
        assert capsys.readouterr().out.splitlines() == [warning.format(model)]
