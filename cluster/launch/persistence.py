"""Checkpoints persisted to Ray Train storage (a cloud URI or a shared path) and restored.

Every rank writes its DeepSpeed files into the run directory on its own node. With storage,
every rank then reports its own files to Ray Train, which merges all ranks' uploads into one
checkpoint directory in storage and registers it only once every rank has reported (the
known pitfall of persisting rank 0's shard alone does not arise). After a restart, possibly
on other nodes, one process per node downloads the newest registered checkpoint into the local
run directory, unless a newer complete one is already there; the loop then resumes from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Any

from bertforge.cluster.launch.paths import absolute, stable_name
from bertforge.training.checkpoint import (
    COMMIT_MARKER,
    METADATA_NAME,
    checkpoints_root,
    committed_steps,
    tag_for_step,
)
from bertforge.training.distributed import barrier
from bertforge.training.errors import UserInputError
from bertforge.training.metrics import console
from bertforge.training.object_storage import checking_filesystem_of, storage_error

# DeepSpeed and our RNG files carry the data-parallel rank that wrote them; the rest (model
# states, marker, metadata, vocab) come from rank 0.
_RANK_IN_NAME = re.compile(r"(?:pp_rank_|rng_rank_)0*(\d+)")


def storage_run_name(run_dir: str) -> str:
    """Ray Train's name for a run directory's run in storage: its last component and a digest
    of its whole path (`paths.stable_name`), so that two runs named alike (every pipeline's
    `runs/phase1`, `exp1/bert` and `exp2/bert`) never share one, nor restore each other's
    checkpoints, while a resubmitted `submit` job finds its run's again."""
    digest = hashlib.sha256(stable_name(run_dir).encode("utf-8")).hexdigest()[:10]
    return f"{os.path.basename(absolute(run_dir))}-{digest}"


def check_storage_scheme(storage: str) -> None:
    """A URI whose scheme no filesystem of pyarrow's serves (`foo://`, `gcs://`), or a local
    path that is a file, refused before anything is made: found by the run lock in storage,
    either left an empty run directory behind."""
    import pyarrow.fs as pafs

    if "://" not in storage:
        if os.path.isfile(storage):
            raise UserInputError(f"--storage {storage} is a file, not a directory (give "
                                 "gs://BUCKET/PATH, s3://, or a local or mounted folder)")
        return
    try:
        pafs.FileSystem.from_uri(storage)
    except ValueError as error:  # pyarrow's ArrowInvalid
        raise UserInputError(f"--storage {storage}: {error} (give gs://BUCKET/PATH, s3://, or "
                             "a local or mounted folder)") from error


def stored_checkpoints(storage: str, name: str) -> list[str]:
    """The checkpoint directories (`step_NNNNNNNN`) that storage holds for the run `name`."""
    import pyarrow.fs as pafs

    try:
        if "://" in storage:
            filesystem, root = checking_filesystem_of(storage)  # read before the run starts
        else:
            filesystem, root = pafs.LocalFileSystem(), os.path.abspath(storage)
        selector = pafs.FileSelector(f"{root.rstrip('/')}/{name}", allow_not_found=True)
        infos = filesystem.get_file_info(selector)
    except OSError as error:
        raise UserInputError(f"{storage} could not be listed: {storage_error(error)}") from error
    return sorted(info.base_name for info in infos
                  if info.type == pafs.FileType.Directory
                  and _CHECKPOINT_DIR.fullmatch(info.base_name))


_CHECKPOINT_DIR = re.compile(r"step_\d+")


def files_of_rank(names: list[str], rank: int) -> list[str]:
    """The files of one checkpoint directory that `rank` uploads."""
    mine = []
    for name in names:
        match = _RANK_IN_NAME.search(name)
        owner = int(match.group(1)) if match else 0
        if owner == rank:
            mine.append(name)
    return sorted(mine)


def report_checkpoint(metrics: dict[str, Any]) -> None:
    """Collective: every rank uploads its own files of the checkpoint at metrics' path."""
    import ray.train

    path, rank = metrics["checkpoint_path"], ray.train.get_context().get_world_rank()
    staging = tempfile.mkdtemp(prefix=f".upload_rank{rank}_", dir=os.path.dirname(path))
    try:
        for name in files_of_rank(os.listdir(path), rank):
            os.link(os.path.join(path, name), os.path.join(staging, name))  # no copy
        ray.train.report(
            {"step": metrics["step"], "run_id": metrics.get("run_id")},
            checkpoint=ray.train.Checkpoint.from_directory(staging),
            checkpoint_dir_name=os.path.basename(path),
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def restore_latest(run_dir: str) -> int | None:
    """Bring Ray's newest registered checkpoint into run_dir; returns its step (or None).

    Collective. The local rank 0 of each node downloads; the others wait at the barrier.
    """
    import ray.train
    import ray.train.torch

    checkpoint = ray.train.get_checkpoint()
    step = None
    if checkpoint is not None and ray.train.get_context().get_local_rank() == 0:
        step = _download_if_newer(checkpoint, run_dir)
    # Before the engine exists: the device Ray Train gave this worker (its GPU under NCCL).
    barrier(ray.train.torch.get_device())
    return step


def _download_if_newer(checkpoint, run_dir: str) -> int:
    root = checkpoints_root(run_dir)
    os.makedirs(root, exist_ok=True)
    incoming = tempfile.mkdtemp(prefix=".download_", dir=root)
    try:
        checkpoint.to_directory(incoming)
        with open(os.path.join(incoming, METADATA_NAME), encoding="utf-8") as f:
            step = json.load(f)["global_step"]
        if not os.path.exists(os.path.join(incoming, COMMIT_MARKER)):
            raise ValueError(f"the checkpoint in storage at step {step} has no commit marker")
        local = committed_steps(run_dir)
        if not local or local[-1] < step:  # never let a stale local copy win over storage
            target = os.path.join(root, tag_for_step(step))
            shutil.rmtree(target, ignore_errors=True)  # a partial save of that step
            os.replace(incoming, target)
            console(f"[train] restored step {step} from storage into {target}")
        return step
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
