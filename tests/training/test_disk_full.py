"""The disk fills while a run saves a checkpoint: before, DeepSpeed's torch.save failed with
"[enforce fail at inline_container.cc] unexpected pos ..." in a worker traceback, Ray Train
restarted the worker group to train into the same wall, and the partial save kept the space a
rerun needed. Now one line says what happened and what resumes, and the partial save goes."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from bertforge.training import checkpoint
from bertforge.training.config import TrainConfig
from bertforge.training.errors import UserInputError
from bertforge.training.loop import train
from tests.training.conftest import write_dataset

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [40]}, max_seq_length=32)


def config(dataset, run_dir, **overrides):
    values = dict(data_dir=dataset, run_dir=str(run_dir), model=TINY, max_steps=4,
                  micro_batch_size=8, warmup_steps=1, checkpoint_every=2, keep_checkpoints=2,
                  zero_stage=0, precision="fp32")
    return TrainConfig(**{**values, **overrides})


def fill_the_disk_at_save(monkeypatch, step: int, how: str) -> None:
    """The save of `step` writes part of its first file, then the disk is full."""
    save = torch.save

    def full_disk_save(obj, path, *args, **kwargs):
        if checkpoint.tag_for_step(step) not in str(path):
            return save(obj, path, *args, **kwargs)
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        if how == "errno":
            raise OSError(errno.ENOSPC, "No space left on device")
        # torch's zip writer says it without an errno; the disk then has no room left.
        monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                            lambda _: shutil._ntuple_diskusage(10**9, 10**9, 0))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                           "10430464 vs 10430352")

    monkeypatch.setattr(torch, "save", full_disk_save)


@pytest.mark.parametrize("how", ["errno", "no-errno"])
def test_a_full_disk_at_a_save_is_one_line_and_the_partial_save_goes(dataset, tmp_path,
                                                                      monkeypatch, how):
    fill_the_disk_at_save(monkeypatch, step=4, how=how)
    with pytest.raises(UserInputError) as raised:
        train(config(dataset, tmp_path / "run"))
    newest = os.path.join(tmp_path, "run", "checkpoints", "step_00000002")
    assert str(raised.value).startswith(
        f"no space left on the disk of {tmp_path / 'run'} while saving the checkpoint of step "
        f"4; its partial files were removed and the newest committed checkpoint, {newest}, is "
        "whole (")
    assert str(raised.value).endswith(
        "MiB; --keep-checkpoints 2 keeps that many): make room (or keep fewer checkpoints, or "
        "give a --run-dir with more space) and the same command resumes")
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step_00000002"]
    # Room again: the same command resumes from step 2 and finishes.
    monkeypatch.undo()
    assert train(config(dataset, tmp_path / "run")).global_step == 4


def test_a_failed_save_with_room_left_keeps_its_own_error(dataset, tmp_path, monkeypatch):
    def broken(obj, path, *args, **kwargs):
        raise RuntimeError("not the disk")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="^not the disk$"):
        train(config(dataset, tmp_path / "run", max_steps=2))
