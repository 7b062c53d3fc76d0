"""Pruning deletes only the saving run's own checkpoints, never one newer than its save;
a fresh start moves another run's checkpoints aside (files only: no engine)."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

from bertforge.training import checkpoint
from bertforge.training.errors import UserInputError


def fake_checkpoint(run_dir, step: int, run_id: str | None, committed: bool = True) -> None:
    path = run_dir / checkpoint.CHECKPOINTS_DIR / checkpoint.tag_for_step(step)
    path.mkdir(parents=True)
    metadata = {"global_step": step} | ({"run_id": run_id} if run_id else {})
    (path / checkpoint.METADATA_NAME).write_text(json.dumps(metadata))
    if committed:
        (path / checkpoint.COMMIT_MARKER).write_text("{}")


def test_pruning_keeps_other_runs_and_newer_checkpoints(tmp_path):
    for step in (100, 200):
        fake_checkpoint(tmp_path, step, "old")
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step, "new")
    fake_checkpoint(tmp_path, 25, "new", committed=False)  # a killed save of this run
    checkpoint._prune(str(tmp_path), keep=2, run_id="new", step=30)
    assert checkpoint.committed_steps(str(tmp_path)) == [20, 30, 100, 200]
    assert not (tmp_path / "checkpoints" / "step_00000025").exists()
    # Checkpoints saved before runs had ids belong to the run that continues them.
    fake_checkpoint(tmp_path, 5, None)
    checkpoint._prune(str(tmp_path), keep=1, run_id="new", step=30)
    assert checkpoint.committed_steps(str(tmp_path)) == [30, 100, 200]


def test_move_aside_keeps_the_old_run_whole(tmp_path):
    assert checkpoint.move_aside(str(tmp_path)) is None  # nothing committed: nothing to move
    for step in (4, 8):
        fake_checkpoint(tmp_path, step, "old")
    (tmp_path / "metrics.jsonl").write_text('{"step": 8}\n')
    (tmp_path / "logs").mkdir()
    (tmp_path / "profile").mkdir()  # --profile-steps': the old run's (it stayed behind)
    target, steps = checkpoint.move_aside(str(tmp_path))
    assert steps == [4, 8] and os.path.dirname(target) == str(tmp_path / "previous")
    assert checkpoint.committed_steps(target) == [4, 8]
    assert os.path.exists(os.path.join(target, "metrics.jsonl"))
    assert os.path.isdir(os.path.join(target, "profile")) and not (tmp_path / "profile").exists()
    assert checkpoint.committed_steps(str(tmp_path)) == [] and (tmp_path / "logs").exists()
    assert checkpoint.resolve_checkpoint(target).endswith("step_00000008")  # export takes it


def test_a_fresh_start_says_what_the_runs_it_kept_aside_hold(tmp_path):
    """Each --resume never keeps one more run whole under previous/, and nothing prunes it: a
    scheduler restarting so filled the disk while every line named one folder, no size."""
    lines = []
    for n, run_id in enumerate(("first", "second")):
        fake_checkpoint(tmp_path, 4, run_id)
        weights = tmp_path / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt"
        weights.write_bytes(b"\0" * (3 + n) * 2**20)
        target, steps = checkpoint.move_aside(str(tmp_path))
        lines.append(checkpoint.moved_aside_line(str(tmp_path), f"new{n}", target, steps))
    previous = tmp_path / checkpoint.PREVIOUS_DIR
    assert lines[0] == (
        f"[train] new run new0 in {tmp_path} (--resume never): the previous run's 1 "
        f"checkpoint(s) (steps 4-4), metrics and config are kept in {previous / 'first'} (3 MiB; "
        "export or --init-from it takes them)")
    assert lines[1].endswith(f"kept in {previous / 'second'} (4 MiB; export or --init-from it "
                             f"takes them); {previous} holds 2 earlier runs, 7 MiB in all: "
                             "delete those you no longer need")
    assert checkpoint.shown_bytes(int(7.94 * 2**30)) == "7.9 GiB"


def test_truncated_and_raw_files_are_told_apart(tmp_path):
    good = tmp_path / "a.pt"
    torch.save({"x": torch.zeros(3)}, good)
    data = good.read_bytes()
    good.write_bytes(data[:-30])
    with pytest.raises(UserInputError, match=r"a\.pt is truncated or damaged"):
        checkpoint.verify_safe_to_unpickle(str(tmp_path))
    good.write_bytes(b"\x80\x02}q\x00.")  # a raw pickle
    with pytest.raises(UserInputError, match="legacy or raw pickle"):
        checkpoint.verify_safe_to_unpickle(str(tmp_path))


def test_a_nodes_own_parts_are_pruned_to_its_newest_keep(tmp_path):
    for step in (10, 20, 30, 40, 50):
        fake_checkpoint(tmp_path, step, None, committed=False)  # this node's parts: no marker
    fake_checkpoint(tmp_path, 5, "run", committed=True)  # restored from storage: whole
    # A removal killed part-way on this node: cleared here too (GBs of a node's parts).
    (tmp_path / checkpoint.CHECKPOINTS_DIR / ".retired-killed" / "step_00000001").mkdir(
        parents=True)
    checkpoint.prune_node_copies(str(tmp_path), keep=2, step=40)
    names = sorted(os.listdir(tmp_path / checkpoint.CHECKPOINTS_DIR))
    assert names == ["step_00000005", "step_00000030", "step_00000040", "step_00000050"]


def _rank_on_its_own_node(rank: int, world_size: int, port: int, cfg_dict: dict) -> None:
    """Rank `rank` alone on its node (LOCAL_RANK 0), with a run directory of its own."""
    from bertforge.training.config import TrainConfig
    from bertforge.training.loop import train
    from tests.support.local_cluster import as_local_rank

    as_local_rank(rank, world_size, port)
    os.environ["LOCAL_RANK"] = "0"
    cfg = TrainConfig.from_dict({**cfg_dict, "run_dir": f"{cfg_dict['run_dir']}-node{rank}"})
    train(cfg)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_node_with_a_run_directory_of_its_own_keeps_only_the_newest_parts(tmp_path):
    """With --storage, nodes may keep their own run directories; only rank 0 pruned, so the
    other nodes kept their part of every save (ZeRO: a share of the weights and moments) until
    the disk filled."""
    import torch.multiprocessing as mp

    from tests.support.local_cluster import free_port
    from tests.training.conftest import write_dataset
    from tests.training.test_loop import config

    data = write_dataset(str(tmp_path / "data"), {"train": [64], "validation": [8]})
    cfg = config(data, tmp_path / "run", max_steps=5, checkpoint_every=1, keep_checkpoints=2,
                 zero_stage=1, precision="fp32", eval_every=0)
    mp.spawn(_rank_on_its_own_node, args=(2, free_port(), cfg.to_dict()), nprocs=2)
    assert checkpoint.committed_steps(str(tmp_path / "run-node0")) == [4, 5]
    parts = sorted(os.listdir(tmp_path / "run-node1" / checkpoint.CHECKPOINTS_DIR))
    assert parts == ["step_00000004", "step_00000005"]
    assert any(name.startswith("zero_pp_rank_1") for name in
               os.listdir(tmp_path / "run-node1" / checkpoint.CHECKPOINTS_DIR / parts[-1]))


def test_a_pruned_checkpoint_is_never_seen_part_deleted(tmp_path, monkeypatch):
    """Deleted in place, a checkpoint's commit marker could outlive its weights, and an export
    beside the train would pick it as complete: it leaves the step names first, whole."""
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step, "run")
    seen_while_deleting = []
    rmtree = shutil.rmtree

    def watched_rmtree(path, *args, **kwargs):
        deleting = {int(name[len("step_"):]) for _, dirs, _ in os.walk(path)
                    for name in dirs if name.startswith("step_")}
        deleting |= {int(os.path.basename(path)[len("step_"):])} if "step_" in path else set()
        if deleting:
            seen_while_deleting.append((deleting, checkpoint.committed_steps(str(tmp_path))))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", watched_rmtree)
    checkpoint._prune(str(tmp_path), keep=1, run_id="run", step=3)
    assert seen_while_deleting == [({1}, [2, 3]), ({2}, [3])]
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000003"]
    # A removal killed part-way leaves its renamed folder: the next prune clears it.
    (tmp_path / "checkpoints" / ".retired-killed" / "step_00000002").mkdir(parents=True)
    checkpoint._prune(str(tmp_path), keep=1, run_id="run", step=3)
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000003"]


@pytest.mark.parametrize("refused", ["rename", "mkdtemp"])
def test_where_a_checkpoint_cannot_be_renamed_its_marker_goes_first(tmp_path, monkeypatch,
                                                                   refused):
    """Some FUSE mounts cannot rename a directory, and a full disk cannot make the one it
    would go to: pruning (which is to make room) must not fail the run there, and the
    checkpoint stops counting before its weights go."""
    for step in (1, 2):
        fake_checkpoint(tmp_path, step, "run")
    order = []
    remove, rmtree = os.remove, shutil.rmtree

    def no_rename(*args, **kwargs):
        raise OSError(errno.ENOTSUP if refused == "rename" else errno.ENOSPC, "refused")

    def watched_remove(path, *args, **kwargs):
        order.append(("remove", os.path.basename(path)))
        remove(path, *args, **kwargs)

    def watched_rmtree(path, *args, **kwargs):
        order.append(("rmtree", os.path.basename(path)))
        rmtree(path, *args, **kwargs)

    if refused == "rename":
        monkeypatch.setattr(checkpoint.os, "rename", no_rename)
    else:
        monkeypatch.setattr(checkpoint.tempfile, "mkdtemp", no_rename)
    monkeypatch.setattr(checkpoint.os, "remove", watched_remove)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", watched_rmtree)
    checkpoint._prune(str(tmp_path), keep=1, run_id="run", step=2)
    assert order[:2] == [("remove", checkpoint.COMMIT_MARKER), ("rmtree", "step_00000001")]
    assert os.listdir(tmp_path / "checkpoints") == ["step_00000002"]


class _FilesEngine:
    """DeepSpeed's save_checkpoint as far as files go: a weights file and an optimizer file."""

    device = torch.device("cpu")

    def save_checkpoint(self, root, tag, client_state, save_latest):
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            torch.save({"client_state": client_state}, os.path.join(root, tag, name))


def test_a_checkpoints_files_are_on_the_disk_before_its_commit_marker(tmp_path, monkeypatch):
    """COMMITTED vouches for the files beside it: without an fsync of them (and of itself) a
    power loss could keep the marker and lose the weights (a new file's data reaches the disk
    after its name, on ext4 and XFS), and the resume loaded empty files as the newest
    checkpoint. Every file is synced before the marker lands; the marker is synced itself."""
    synced: list[str] = []
    at_commit: list[list[str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst, *args, **kwargs):
        if os.path.basename(dst) == checkpoint.COMMIT_MARKER:
            at_commit.append(list(synced))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    monkeypatch.setattr(checkpoint.os, "replace", recording_replace)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n")
    path = checkpoint.save(_FilesEngine(), str(tmp_path / "run"), 2, {"step": 2},
                           metadata={"run_id": "r"}, vocab_path=str(vocab), keep=2)
    files = {os.path.realpath(os.path.join(path, name)) for name in os.listdir(path)
             if name != checkpoint.COMMIT_MARKER}
    assert len(files) == 5 and len(at_commit) == 1
    assert files <= set(at_commit[0]), sorted(files - set(at_commit[0]))
    marker_tmp = os.path.realpath(os.path.join(path, checkpoint.COMMIT_MARKER + ".tmp"))
    assert marker_tmp in at_commit[0]
    assert os.path.realpath(path) in synced  # the directory: its names, the marker's too
