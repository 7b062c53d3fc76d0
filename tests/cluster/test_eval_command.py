"""`bertforge eval`: the split scored needs nothing else of the dataset, data longer than the
model's positions and a GPU asked for where there is none are one line before any work, and
`--device` says where it scores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bertforge.cluster.cli import main
from bertforge.training import checkpoint
from bertforge.training import data as data_package
from bertforge.training.config import TrainConfig
from bertforge.training.evaluate import eval_device
from bertforge.training.loop import train
from tests.support.refusals import refused
from tests.training.conftest import read_split_rows, write_dataset


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """The checkpoint of a one-step run of tiny with 64 positions, on 64-token data."""
    root = tmp_path_factory.mktemp("eval")
    data = write_dataset(str(root / "data"), {"train": [24], "validation": [16]})
    run_dir = str(root / "run")
    train(TrainConfig(data_dir=data, run_dir=run_dir,
                      model={"preset": "tiny", "max_position_embeddings": 64}, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=0))
    return root, checkpoint.latest_checkpoint(run_dir)


def test_a_validation_split_alone_is_scored_against_its_own_baseline(short_model, capsys):
    """No train split needed: the baseline's guess is the scored split's most frequent token,
    as the run's own validation takes it."""
    root, ckpt = short_model
    held_out = write_dataset(str(root / "held_out"), {"validation": [16]}, seed=3)
    assert main(["eval", ckpt, "--data", held_out, "--device", "cpu"]) == 0
    said = capsys.readouterr()
    result = json.loads(said.out)  # stdout is the result alone (`> result.json`, `| jq`)
    assert result["num_sequences"] == 16
    assert 0 < result["mlm_baseline_accuracy"] < 1
    # Its first line counts what it scores: 16 sequences, not "1 batch of 64".
    assert f"[eval] {ckpt}: 16 sequences of the validation split in 1 batch\n" in said.err


def test_a_few_batches_of_the_train_split_count_only_their_rows_for_the_baseline(
        short_model, capsys, monkeypatch):
    """`--split train --max-batches 1` streamed the whole train split (terabytes, for a real
    corpus) to find the baseline's guess, before scoring one batch: now it counts the rows it
    scores. The validation split keeps its whole split's guess, as the run's validation."""
    root, ckpt = short_model
    counted_rows = []
    real = data_package.token_frequencies

    def spy(data_dir, split="train", rows=None):
        counted_rows.append((split, None if rows is None else len(rows)))
        return real(data_dir, split, rows)

    monkeypatch.setattr(data_package, "token_frequencies", spy)
    argv = ["eval", ckpt, "--data", str(root / "data"), "--device", "cpu", "--batch-size", "8",
            "--max-batches", "1"]
    assert main([*argv, "--split", "train"]) == 0
    assert main(argv) == 0  # the validation split
    assert counted_rows == [("train", 8), ("validation", None)]
    result = json.loads(capsys.readouterr().out.split("}\n", 1)[0] + "}")
    assert 0 <= result["mlm_baseline_accuracy"] <= 1 and result["num_sequences"] == 8
    # The rows' own counts, their padding left out.
    rows = np.array([3, 0, 17])
    counts = real(str(root / "data"), "train", rows)
    ids = np.concatenate([read_split_rows(str(root / "data"), "train")[i][0] for i in rows])
    assert counts.tolist() == np.bincount(ids, minlength=len(counts)).tolist()


def test_data_longer_than_the_models_positions_is_refused_before_scoring(short_model, capsys):
    root, ckpt = short_model
    longer = write_dataset(str(root / "longer"), {"validation": [8]}, max_seq_length=128)
    refused(["eval", ckpt, "--data", longer], capsys,
            "holds sequences of up to 128 tokens", "max_position_embeddings=64")


def test_data_longer_than_the_model_was_trained_at_is_scored_with_a_warning(short_model, capsys):
    """Positions past the trained length are still random (phase 1 alone: 128): fine-tuning
    warned of it, eval scored such data without a word."""
    root, ckpt = short_model
    run_dir = str(root / "short-run")
    data = write_dataset(str(root / "short"), {"train": [24], "validation": [16]},
                         max_seq_length=32)
    train(TrainConfig(data_dir=data, run_dir=run_dir,
                      model={"preset": "tiny", "max_position_embeddings": 64}, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=0))
    assert main(["eval", run_dir, "--data", str(root / "data"), "--device", "cpu"]) == 0
    assert (f"[eval] warning: {root / 'data'} holds sequences of up to 64 tokens, longer than "
            "the 32 this model was trained at: positions 33-64 keep their random initial "
            "embeddings") in capsys.readouterr().err
    assert main(["eval", run_dir, "--data", data, "--device", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device cuda is valid")
def test_a_gpu_asked_for_where_there_is_none_is_one_line(short_model, capsys):
    root, ckpt = short_model
    refused(["eval", ckpt, "--data", str(root / "data"), "--device", "cuda"], capsys,
            "--device cuda: torch sees no GPU here")


def test_a_bad_option_value_is_one_line_naming_the_flag(tmp_path, capsys):
    """`--max-batches 0` printed the start line ("0 batches of 64") before its error."""
    refused(["eval", str(tmp_path), "--data", str(tmp_path), "--max-batches", "0"], capsys,
            "--max-batches must be at least 1, got 0")
    refused(["eval", str(tmp_path), "--data", str(tmp_path), "--batch-size", "0"], capsys,
            "--batch-size must be at least 1, got 0")


def test_auto_scores_on_the_gpu_when_there_is_one():
    assert eval_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert eval_device("cpu") == "cpu"


def test_a_hugging_face_export_scores_as_its_checkpoint_does(short_model, capsys):
    """A Hugging Face BERT (an export, Google's converted release) was refused as no
    checkpoint: the one way to score a reference model on the same masks."""
    from safetensors.torch import load_file, save_file

    root, ckpt = short_model
    hf = root / "hf"
    assert main(["export", ckpt, "--output", str(hf)]) == 0
    scores = []
    for model in (ckpt, str(hf)):
        capsys.readouterr()
        assert main(["eval", model, "--data", str(root / "data"), "--device", "cpu"]) == 0
        scores.append(json.loads(capsys.readouterr().out))
    assert scores[0] == scores[1]
    assert not (hf / "logs").exists()  # the model's directory is left as it was
    # Without the pretraining heads (a BertModel, a classifier) there is nothing to score.
    bare = root / "bare"
    bare.mkdir()
    for name in ("config.json", "vocab.txt", "tokenizer_config.json"):
        (bare / name).write_bytes((hf / name).read_bytes())
    weights = load_file(str(hf / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("cls.")},
              str(bare / "model.safetensors"), metadata={"format": "pt"})
    refused(["eval", str(bare), "--data", str(root / "data")], capsys,
            f"model {bare} lacks BERT's pretraining heads (masked-LM head, next-sentence head)")
    # Another vocabulary: refused before anything is read.
    (bare / "vocab.txt").write_text((hf / "vocab.txt").read_text() + "extra\n")
    refused(["eval", str(bare), "--data", str(root / "data")], capsys,
            f"{root / 'data'} uses another vocabulary than model {bare}: eval scores a model "
            "on text prepared with its own vocabulary (`bertforge prepare --vocab`")


def test_a_masked_lm_model_without_a_next_sentence_head_is_scored_on_its_masked_lm(
        short_model, capsys):
    """A BertForMaskedLM (no pooler, no next-sentence head: many released BERTs) was refused
    as having no pretraining heads, though its masked-LM head is what eval scores first."""
    from safetensors.torch import load_file, save_file

    root, ckpt = short_model
    hf = root / "hf-for-mlm"
    assert main(["export", ckpt, "--output", str(hf)]) == 0
    mlm = root / "mlm"
    mlm.mkdir()
    for name in ("config.json", "vocab.txt", "tokenizer_config.json"):
        (mlm / name).write_bytes((hf / name).read_bytes())
    weights = load_file(str(hf / "model.safetensors"))
    save_file({k: v for k, v in weights.items()
               if not k.startswith(("cls.seq_relationship.", "bert.pooler."))},
              str(mlm / "model.safetensors"), metadata={"format": "pt"})
    scores = []
    for model in (ckpt, str(mlm)):
        capsys.readouterr()
        assert main(["eval", model, "--data", str(root / "data"), "--device", "cpu"]) == 0
        out, err = capsys.readouterr()
        scores.append((json.loads(out), err))
    (full, _), (masked_lm, said) = scores
    assert masked_lm == {**full, "nsp_accuracy": None, "nsp_loss": None}
    assert (f"[eval] {mlm} has no next-sentence head (a masked-LM model): its masked-LM head "
            "is scored alone") in said
