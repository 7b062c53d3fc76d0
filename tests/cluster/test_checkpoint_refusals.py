"""A damaged, edited or malicious checkpoint is one `error:` line (exit 2) from the driver's
pre-flight, before Ray starts: `export`, `eval`, `train` resuming it or warm-starting from it
(`--init-from`), and `finetune --model` (its `check_model_source`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from bertforge.cluster.cli import main
from bertforge.training import checkpoint
from bertforge.training.config import TrainConfig
from bertforge.training.errors import UserInputError
from bertforge.training.inputs import check_model_source
from bertforge.training.loop import train
from tests.support.refusals import refused
from tests.training.conftest import write_dataset


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(dataset, run directory) of a one-step run of the CLI's default model (tiny)."""
    root = tmp_path_factory.mktemp("refusals")
    data = write_dataset(str(root / "data"), {"train": [40, 30], "validation": [16]})
    run_dir = str(root / "run")
    train(TrainConfig(data_dir=data, run_dir=run_dir, model={"preset": "tiny"}, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=0))
    return data, run_dir


@pytest.fixture
def run_copy(trained, tmp_path):
    """A copy of the trained run to damage, and its checkpoint."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(trained[1], run_dir)
    return run_dir, checkpoint.latest_checkpoint(run_dir)


def edit_metadata(checkpoint_path: str, **model_fields) -> None:
    path = os.path.join(checkpoint_path, checkpoint.METADATA_NAME)
    with open(path) as f:
        metadata = json.load(f)
    metadata["model_config"].update(model_fields)
    with open(path, "w") as f:
        json.dump(metadata, f)


def test_config_that_disagrees_with_the_weights_is_one_line_in_export_and_eval(
        trained, run_copy, tmp_path, capsys):
    data, _ = trained
    run_dir, ckpt = run_copy
    edit_metadata(ckpt, hidden_size=256, num_attention_heads=4)  # as if copied from mini
    # The embedding's rows: the vocabulary padded to a multiple of 64.
    expected = (f"{ckpt}/bertforge.json does not match the checkpoint's weights",
                "bert.embeddings.word_embeddings.weight is [320, 128] in "
                f"{ckpt}/mp_rank_00_model_states.pt", "but [320, 256] by its model_config")
    refused(["export", run_dir, "--output", str(tmp_path / "hf")], capsys, *expected)
    refused(["eval", ckpt, "--data", data, "--max-batches", "1"], capsys, *expected)
    assert not os.path.exists(tmp_path / "hf")
    # A layer more than the weights hold; a file that is not JSON.
    edit_metadata(ckpt, hidden_size=128, num_attention_heads=2, num_hidden_layers=3)
    refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys,
            "are not in the weights (first: bert.encoder.layer.2.")
    with open(os.path.join(ckpt, checkpoint.METADATA_NAME), "a") as f:
        f.write("}{")
    refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys,
            f"{ckpt}/bertforge.json is not valid JSON")


def test_truncated_file_is_named_truncated(trained, run_copy, tmp_path, capsys):
    data, _ = trained
    run_dir, ckpt = run_copy
    path = os.path.join(ckpt, "mp_rank_00_model_states.pt")
    with open(path, "rb") as f:
        content = f.read()
    with open(path, "wb") as f:
        f.write(content[: len(content) // 3])
    err = refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys,
                  f"{path} is truncated or damaged", "refusing to load it")
    assert "legacy" not in err
    refused(["train", "--data", data, "--run-dir", run_dir], capsys,
            f"{path} is truncated or damaged")
    with open(path, "wb") as f:
        pass  # empty: a copy that wrote nothing
    refused(["eval", ckpt, "--data", data], capsys, f"{path} is truncated or damaged")


def test_a_checkpoint_without_its_metadata_says_so(trained, run_copy, tmp_path, capsys):
    """It said "[Errno 2] No such file or directory: '.../bertforge.json'" and nothing more."""
    _, ckpt = run_copy
    os.remove(os.path.join(ckpt, checkpoint.METADATA_NAME))
    refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys,
            f"checkpoint {ckpt} lacks its bertforge.json", "a checkpoint not made by bertforge")


class _Payload:
    """What a tampered checkpoint smuggles in: unpickling it would create `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_malicious_checkpoint_is_refused_before_ray_and_never_unpickled(
        trained, run_copy, tmp_path, capsys):
    data, _ = trained
    run_dir, ckpt = run_copy
    ran = tmp_path / "payload-ran"
    rng = os.path.join(ckpt, "rng_rank_00000.pt")
    torch.save({"payload": _Payload(str(ran))}, rng)
    why = (f"{rng} holds objects outside the types a checkpoint may contain", "refusing")
    refused(["train", "--data", data, "--run-dir", run_dir], capsys, *why)  # --resume auto
    refused(["train", "--data", data, "--run-dir", str(tmp_path / "new"),
             "--init-from", run_dir], capsys, *why)
    refused(["export", run_dir, "--output", str(tmp_path / "hf")], capsys, *why)
    with pytest.raises(UserInputError, match="holds objects outside"):
        check_model_source(run_dir)  # finetune --model
    assert not ran.exists()


def test_object_storage_paths_are_one_line_not_a_local_gs_folder(
        trained, tmp_path, monkeypatch, capsys):
    """`--output gs://...` used to export into ./gs:/... and report success."""
    _, run_dir = trained
    monkeypatch.chdir(tmp_path)
    refused(["export", run_dir, "--output", "gs://bucket/models/hf"], capsys,
            "gs://bucket/models/hf: an export in object storage", "gcloud storage cp -r")
    refused(["export", "gs://bucket/runs/phase1", "--output", "hf"], capsys,
            "gs://bucket/runs/phase1: a checkpoint in object storage")
    assert os.listdir(tmp_path) == []


def test_exporting_an_export_says_it_is_one_already(trained, tmp_path, capsys):
    """It said "neither a complete checkpoint nor a run with one" of a Hugging Face directory."""
    _, run_dir = trained
    hf = str(tmp_path / "hf")
    assert main(["export", run_dir, "--output", hf]) == 0
    capsys.readouterr()
    refused(["export", hf, "--output", str(tmp_path / "again")], capsys,
            f"{hf} is a Hugging Face model directory already: export reads a bertforge "
            "checkpoint or run directory")
    assert not os.path.exists(tmp_path / "again")


def test_a_checkpoint_missing_other_ranks_files_is_one_line(trained, tmp_path, capsys):
    """A ZeRO checkpoint holds each rank's part of the weights in that rank's file: one of two
    ranks' (a node that kept its own run directory) was a KeyError traceback from export."""
    data, _ = trained
    run_dir = str(tmp_path / "zero1")
    train(TrainConfig(data_dir=data, run_dir=run_dir, model={"preset": "tiny"}, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=1))
    ckpt = checkpoint.latest_checkpoint(run_dir)
    assert main(["export", ckpt, "--output", str(tmp_path / "whole")]) == 0  # rank 0 of 1
    capsys.readouterr()  # its lines (on stderr: stdout holds the export's path alone)
    path = os.path.join(ckpt, checkpoint.METADATA_NAME)
    with open(path) as f:
        metadata = json.load(f)
    with open(path, "w") as f:
        json.dump({**metadata, "world_size": 2}, f)  # as saved by rank 0 of two nodes
    refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys,
            "lacks the optimizer files of rank(s) 1 of its 2", "--storage")
    refused(["eval", ckpt, "--data", data], capsys, "rank(s) 1 of its 2")


def test_metadata_without_what_loads_read_is_one_line(run_copy, tmp_path, capsys):
    """A bertforge.json without lower_case (edited, or another tool's) was a KeyError
    traceback from export, after the weights had been read."""
    _, ckpt = run_copy
    path = os.path.join(ckpt, checkpoint.METADATA_NAME)
    with open(path) as f:
        metadata = json.load(f)
    del metadata["lower_case"]
    with open(path, "w") as f:
        json.dump(metadata, f)
    refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys,
            f"{path} lacks lower_case")


def test_a_vocabulary_that_is_not_the_checkpoints_is_one_line(trained, run_copy, tmp_path,
                                                              capsys):
    """A checkpoint's vocab.txt replaced by another of the same size (its lines reordered: a
    copy from another run, an edit) was exported as the model's tokenizer, every word then
    another id, and fine-tuned with: its bertforge.json's vocab_sha256 says which it was."""
    _, ckpt = run_copy
    path = os.path.join(ckpt, "vocab.txt")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines[:5] + lines[5:][::-1]) + "\n")
    expected = (f"{path} is not the vocabulary this checkpoint was trained with",
                "copy back the vocab.txt of the dataset it was trained on")
    refused(["export", ckpt, "--output", str(tmp_path / "hf")], capsys, *expected)
    assert not os.path.exists(tmp_path / "hf")
    with pytest.raises(UserInputError, match="is not the vocabulary this checkpoint"):
        check_model_source(ckpt)  # finetune --model's and --init-from's pre-flight
