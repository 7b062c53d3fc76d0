"""A train still running in a run removes its older checkpoints after each save
(--keep-checkpoints). Export, eval, warm starts and fine-tuning read a run's newest beside it:
where the one they picked goes while they read it, they take the newer one, and a checkpoint
named by its own path that goes is one clear error, not a missing file's."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bertforge.cluster.cli import main
from bertforge.training import checkpoint, export
from bertforge.training.config import TrainConfig
from bertforge.training.errors import UserInputError
from bertforge.training.eval_options import EvalOptions
from bertforge.training.evaluate import evaluate_checkpoint
from bertforge.training.finetune.load import load_pretrained
from bertforge.training.loop import train
from bertforge.training.warm_start import read_initial_weights
from tests.training.conftest import write_dataset

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [40], "validation": [20]}, max_seq_length=32)


@pytest.fixture(scope="module")
def trained_run(dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    train(TrainConfig(data_dir=dataset, run_dir=str(run_dir), model=TINY, max_steps=2,
                      micro_batch_size=8, warmup_steps=1, checkpoint_every=1,
                      keep_checkpoints=5, zero_stage=0, precision="fp32"))
    return run_dir


@pytest.fixture
def run_dir(trained_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


def a_train_saves_and_prunes(run_dir) -> None:
    """What a running train does between two reads: commits step N + 1 (here a copy of step
    N) and keeps only it."""
    newest = checkpoint.latest_checkpoint(str(run_dir))
    metadata = checkpoint.read_metadata(newest)
    step = metadata["global_step"] + 1
    saved = os.path.join(os.path.dirname(newest), checkpoint.tag_for_step(step))
    shutil.copytree(newest, saved, ignore=shutil.ignore_patterns(checkpoint.COMMIT_MARKER))
    with open(os.path.join(saved, checkpoint.METADATA_NAME), "w", encoding="utf-8") as f:
        json.dump({**metadata, "global_step": step}, f)
    checkpoint._write_marker(saved, {"step": step})
    checkpoint._prune(str(run_dir), keep=1, run_id=metadata["run_id"], step=step)


def interrupted_once(read, run_dir):
    """`read`, with a train's save and prune just before its first call."""
    calls = []

    def wrapped(*args, **kwargs):
        if not calls:
            a_train_saves_and_prunes(run_dir)
        calls.append(args)
        return read(*args, **kwargs)

    return wrapped, calls


def test_export_of_a_run_takes_the_newer_checkpoint_when_its_pick_is_removed(
        run_dir, tmp_path, monkeypatch, capsys):
    load, calls = interrupted_once(export.load_model, run_dir)
    monkeypatch.setattr(export, "load_model", load)
    assert main(["export", str(run_dir), "--output", str(tmp_path / "hf")]) == 0
    newest = os.path.join(run_dir, "checkpoints", "step_00000003")
    # Picked step 2, which went before it was read; then step 3, whose export is whole.
    assert [os.path.basename(path) for path, in calls] == ["step_00000002", "step_00000003"]
    assert export.exported_source(str(tmp_path / "hf")) == {
        "checkpoint": newest, "run_id": checkpoint.read_metadata(newest)["run_id"],
        "global_step": 3, "warm_start": None}
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "vocab.txt"]
    assert f", step 3, from {newest}\n" in capsys.readouterr().err


def test_a_checkpoint_removed_half_way_through_its_read_is_read_again_from_the_newest(
        run_dir, tmp_path, monkeypatch):
    """The train prunes after the export has read the checkpoint's bertforge.json and before
    it reads the weights."""
    load_weights, calls = interrupted_once(checkpoint.load_fp32_state_dict, run_dir)
    monkeypatch.setattr(checkpoint, "load_fp32_state_dict", load_weights)
    export.export_checkpoint(str(run_dir), str(tmp_path / "hf"))
    assert [os.path.basename(path) for path, in calls] == ["step_00000002", "step_00000003"]
    assert export.exported_source(str(tmp_path / "hf"))["global_step"] == 3


def test_a_named_checkpoint_removed_while_it_is_read_is_one_clear_error(run_dir, tmp_path,
                                                                        monkeypatch):
    load, _ = interrupted_once(export.load_model, run_dir)
    monkeypatch.setattr(export, "load_model", load)
    named = os.path.join(run_dir, "checkpoints", "step_00000002")
    with pytest.raises(UserInputError, match=r"step_00000002 was removed while it was read: a "
                       r"bertforge train still running in its run keeps only its newest "
                       r"--keep-checkpoints; give the run directory"):
        export.export_checkpoint(named, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_a_named_checkpoint_gone_before_it_is_read_says_why(dataset, tmp_path, capsys):
    """A run's checkpoint that its train pruned between `ls` and `eval` (or an old step named)
    was "does not exist" or "neither a complete checkpoint nor a run with one"."""
    run_dir = tmp_path / "run"
    for step in (10, 20):
        committed = run_dir / "checkpoints" / f"step_{step:08d}"
        committed.mkdir(parents=True)
        (committed / checkpoint.COMMIT_MARKER).write_text("")
    (run_dir / "checkpoints" / "step_00000030").mkdir()  # being saved: not gone
    gone = run_dir / "checkpoints" / "step_00000005"
    said = (f"checkpoint {gone} is no longer there: its run keeps only its newest "
            f"--keep-checkpoints (now step_00000020); give the run directory {run_dir}")
    for argv in (["export", str(gone), "--output", str(tmp_path / "hf")],
                 ["eval", str(gone), "--data", str(dataset)]):
        assert main(argv) == 2
        assert said in capsys.readouterr().err
    with pytest.raises(UserInputError, match="no longer there"):
        checkpoint.resolve_checkpoint(str(gone))
    saving = run_dir / "checkpoints" / "step_00000030"
    with pytest.raises(ValueError, match="neither a complete checkpoint") as error:
        checkpoint.resolve_checkpoint(str(saving))
    assert "no longer there" not in str(error.value)


def test_eval_warm_start_and_fine_tuning_read_a_run_beside_its_train(run_dir, dataset,
                                                                     monkeypatch):
    load, calls = interrupted_once(checkpoint.load_model, run_dir)
    monkeypatch.setattr(checkpoint, "load_model", load)
    result = evaluate_checkpoint(str(run_dir), dataset, EvalOptions(max_batches=1))
    assert len(calls) == 2 and result.num_sequences > 0

    calls.clear()
    initial = read_initial_weights(str(run_dir))
    assert len(calls) == 2 and initial.config.hidden_size == 32 and initial.state_dict

    # A fine-tune reads the vocabulary until its export: it keeps a copy of its own.
    copy_dir = run_dir.parent / "fine-tune's"
    copy_dir.mkdir()
    pretrained = load_pretrained(str(run_dir), vocab_copy_dir=str(copy_dir))
    assert pretrained.provenance["step"] == 4
    a_train_saves_and_prunes(run_dir)
    assert pretrained.vocab_path == str(copy_dir / "vocab.txt")
    with open(pretrained.vocab_path, encoding="utf-8") as f:
        assert f.read().startswith("[PAD]")


def test_a_failing_read_of_a_checkpoint_still_there_keeps_its_own_error(run_dir):
    def broken(path):
        raise ValueError("its own error")

    with pytest.raises(ValueError, match="^its own error$"):
        checkpoint.read_newest(str(run_dir), broken)


def test_the_universal_copy_beside_a_checkpoint_is_named_as_such(run_dir, tmp_path, capsys):
    """A resume on another number of workers leaves step_N.universal in checkpoints/; export
    and eval of it failed with "No such file ... bertforge.json"."""
    newest = checkpoint.latest_checkpoint(str(run_dir))
    universal = newest + checkpoint.UNIVERSAL_SUFFIX
    shutil.copytree(newest, universal, ignore=shutil.ignore_patterns(checkpoint.METADATA_NAME))
    assert main(["export", universal, "--output", str(tmp_path / "hf")]) == 2
    assert (f"{universal} is DeepSpeed's universal copy of checkpoint {newest}, made to resume "
            "it on another number of workers: give that checkpoint, or the run directory"
            in capsys.readouterr().err)
