"""`train --init-from SOURCE` without --preset or --recipe trains SOURCE's model, as
`from_pretrained` takes a model's own, and a resume that names no model keeps its run's.
Before, each trained the default preset (tiny): a warm start from a Hugging Face directory
failed with "another architecture" once Ray had started its workers, and a resume was refused
with advice no flag could follow. A model that does not fit, named by --preset, is refused by
the driver before Ray starts, for a Hugging Face directory as for a checkpoint."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bertforge.cluster.cli import build_parser, main, train_config_from_args
from bertforge.training import checkpoint
from bertforge.training.config import TrainConfig
from bertforge.training.loop import train
from tests.support.refusals import refused
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow  # two short real runs (DeepSpeed on the CPU)

# Not a preset's: the default (tiny) would not fit it.
SOURCE_MODEL = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2,
                "intermediate_size": 64}
ONE_STEP = ["--steps", "1", "--batch-size", "8", "--warmup-steps", "0", "--precision", "fp32",
            "--zero-stage", "0"]


def train_config(*argv: str) -> TrainConfig:
    return train_config_from_args(build_parser().parse_args(["train", *argv]))


def test_a_warm_start_continues_its_sources_model_and_a_preset_that_does_not_fit_is_refused(
        tmp_path, capsys):
    data = write_dataset(str(tmp_path / "data"), {"train": [40, 30], "validation": [16]})
    source = tmp_path / "source"
    train(TrainConfig(data_dir=data, run_dir=str(source), model=SOURCE_MODEL, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=0))
    hf = tmp_path / "hf"
    assert main(["export", str(source), "--output", str(hf)]) == 0
    capsys.readouterr()
    expected = checkpoint.model_config_of(checkpoint.latest_checkpoint(str(source))).to_dict()
    del expected["vocab_size"]  # always the data's
    assert expected["hidden_size"] == 32

    for given in (source, hf):  # a run directory, a Hugging Face directory
        cfg = train_config("--data", data, "--run-dir", str(tmp_path / "new"),
                           "--init-from", str(given))
        assert cfg.model == expected, given
    assert train_config("--data", data, "--run-dir", str(tmp_path / "new"), "--init-from",
                        str(hf), "--preset", "mini").model == {"preset": "mini"}

    # It trains from the source's weights, and its config.json records that model.
    continued = tmp_path / "continued"
    train(train_config("--data", data, "--run-dir", str(continued), "--init-from", str(hf),
                       *ONE_STEP))
    recorded = json.loads((continued / "config.json").read_text())["train"]
    assert recorded["model"] == expected and recorded["init_from"] == str(hf)
    # One line says it warm-started, and from what (a run: the checkpoint it picked); before,
    # nothing told a warm start from a run from scratch.
    assert (f"[train] warm start: weights from {hf} (a Hugging Face BERT); the optimizer, the "
            "learning-rate schedule and the data order start anew") in capsys.readouterr().out
    picked = checkpoint.latest_checkpoint(str(source))
    run_id = checkpoint.checkpoint_run_id(picked)
    train(train_config("--data", data, "--run-dir", str(tmp_path / "from-run"), "--init-from",
                       str(source), *ONE_STEP))
    assert f"[train] warm start: weights from {picked} (step 1 of run {run_id}); " in \
        capsys.readouterr().out

    # A resume keeps its checkpoint's model, though its source has gone since, and so does a
    # resume that names no model at all: no flag could name these fields ("another
    # architecture than the requested model", the default tiny, before).
    moved = tmp_path / "hf-moved"
    shutil.move(str(hf), str(moved))
    assert train_config("--data", data, "--run-dir", str(continued), "--init-from",
                        str(hf)).model == expected
    assert train_config("--data", data, "--run-dir", str(source)).model == expected
    further = ONE_STEP[:1] + ["2"] + ONE_STEP[2:]
    resumed = train(train_config("--data", data, "--run-dir", str(continued), *further))
    assert resumed.global_step == 2
    assert "warm start" not in capsys.readouterr().out  # a resume has weights of its own
    assert train_config("--data", data, "--run-dir", str(tmp_path / "fresh")).model == \
        {"preset": "tiny"}

    # A source without a vocabulary trains, and says it could not be checked.
    bare = tmp_path / "hf-bare"
    shutil.copytree(moved, bare)
    for name in ("vocab.txt", "tokenizer.json"):
        (bare / name).unlink(missing_ok=True)
    capsys.readouterr()
    train(train_config("--data", data, "--run-dir", str(tmp_path / "from-bare"), "--init-from",
                       str(bare), *ONE_STEP))
    assert f"[train] warning: init_from {bare} has no vocab.txt or tokenizer.json, so its " \
        "vocabulary is not checked" in capsys.readouterr().out

    # A preset that does not fit the source, or another vocabulary: refused by the driver.
    run = ["train", "--data", data, "--run-dir", str(tmp_path / "p2"), "--workers", "1"]
    refused([*run, "--init-from", str(moved), "--preset", "mini"], capsys,
            f"init_from {moved} has another architecture than the model to train (source "
            "!= model: hidden_size 32 != 256")
    with open(moved / "vocab.txt", "a", encoding="utf-8") as f:
        f.write("extra\n")
    refused([*run, "--init-from", str(moved)], capsys, f"init_from {moved} was trained with "
            "another vocabulary than the training data")
    assert not os.path.exists(tmp_path / "p2")
