"""Checkpoints: DeepSpeed state on every rank plus a commit marker written last.

Layout under a run directory:

    checkpoints/step_00000300/            one DeepSpeed tag
        mp_rank_00_model_states.pt        DeepSpeed (module, client_state)
        *_optim_states.pt                 DeepSpeed (one per data-parallel rank under ZeRO)
        rng_rank_00000.pt                 each rank's torch RNG (dropout), tensors only
        bertforge.json                    model config, vocab hash, casing: enough to export/eval
        vocab.txt                         a copy, so the checkpoint stands alone
        COMMITTED                         JSON {step, ...}: the checkpoint counts only with it
    checkpoints/step_00000300.universal/  made on a resume with another number of workers
        mp_rank_00_model_states.pt ...    under ZeRO >= 1 (see convert_to_universal): DeepSpeed's
        zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt  universal layout, whole (unsharded) tensors
        COMMITTED                         written last, as above

A kill while saving leaves a tag without COMMITTED; it is ignored on resume and removed later,
or cleared by the next save of its step (`_clear_step`).

Each run has an id (its start, UTC) recorded in its checkpoints' bertforge.json. A fresh start
on a run directory that holds committed checkpoints moves them aside first (`move_aside`:
RUN_DIR/previous/<UTC time>/, with the old run's metrics and config), and pruning only ever
deletes checkpoints of the run that saves, never one newer than its own latest save: no
command that exits 0 loses a committed checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from bertforge.pipelines.contract.durable_files import fsync_path
from bertforge.training.distributed import barrier, local_rank
from bertforge.training.errors import UserInputError, disk_full, first_line
from bertforge.training.metrics import METRICS_NAME
from bertforge.training.profiling import PROFILE_DIR

T = TypeVar("T")

CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARKER = "COMMITTED"
METADATA_NAME = "bertforge.json"
UNIVERSAL_SUFFIX = ".universal"
_TAG_PATTERN = re.compile(r"^step_(\d{8})$")
_UNIVERSAL_PATTERN = re.compile(r"^step_(\d{8})\.universal$")
_UNIVERSAL_STAGING_PREFIX = ".universal-staging-"
_RETIRED_PREFIX = ".retired-"  # a pruned checkpoint on its way out (`_retire`)
# How often a reader picks a run's newest checkpoint again when a running train prunes the one
# it is reading (`read_newest`): the tries follow one another at once, each on the newest.
READ_TRIES = 3
PREVIOUS_DIR = "previous"  # RUN_DIR/previous/<UTC time>/: the runs a fresh start moved aside
# The log a train's driver opens first in its run directory (cluster.launch.ray_train), before
# its workers start: a run's only file but its lock for the first seconds, or for good when it
# stopped then.
TRAIN_LOG = os.path.join("logs", "train.log")
# What a run writes beside its checkpoints, moved aside with them (training.metrics, loop).
_RUN_FILES = (METRICS_NAME, "tensorboard", "config.json", PROFILE_DIR)
# The MLM decoder is tied to the word embeddings, so a checkpoint may carry it once.
_TIED = ("cls.predictions.decoder.weight",)


def tag_for_step(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS_DIR)


def committed_steps(run_dir: str) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = _TAG_PATTERN.match(name)
        if match and os.path.exists(os.path.join(root, name, COMMIT_MARKER)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def cut_saves(run_dir: str, after: int) -> list[int]:
    """Steps after `after` whose save was cut short (a kill mid-save): folders without their
    commit marker, which a resume from `after` passes over and its saves clear."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root)
                  if (m := _TAG_PATTERN.match(name)) and int(m.group(1)) > after
                  and not os.path.exists(os.path.join(root, name, COMMIT_MARKER)))


def resumes_a_checkpoint(run_dir: str, resume: bool) -> bool:
    """Whether a `train` with `--resume auto` (`resume`) continues a committed checkpoint of
    its own: such a run reads no --init-from, and its engine is the checkpoint's."""
    return resume and bool(committed_steps(run_dir))


def latest_checkpoint(run_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None."""
    steps = committed_steps(run_dir)
    return os.path.join(checkpoints_root(run_dir), tag_for_step(steps[-1])) if steps else None


def save(
    engine, run_dir: str, step: int, client_state: dict[str, Any], *,
    metadata: dict[str, Any], vocab_path: str, keep: int,
) -> str:
    """Collective: every rank calls it. Returns the checkpoint path once committed."""
    root = checkpoints_root(run_dir)
    tag = tag_for_step(step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(root, tag)
    if local_rank() == 0:  # each node its own disk's; all of it before any rank writes
        _clear_step(path)
    barrier(engine.device)
    try:
        engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
        if rank == 0:
            _remove_recovery_scripts(root)
        torch.save(_rng_state(), rng_file(path, rank))
        if rank == 0:
            with open(os.path.join(path, METADATA_NAME), "w", encoding="utf-8") as f:
                json.dump({**metadata, "global_step": step}, f, indent=2, sort_keys=True)
            shutil.copyfile(vocab_path, os.path.join(path, "vocab.txt"))
        # This rank's files among them on the disk, not in the page cache (a full disk may
        # say so only here: delayed allocation).
        _sync_files(path)
    except Exception as error:
        if not _disk_full(error, root):
            raise
        if local_rank() == 0:  # this node's copy: never a checkpoint, and it holds the space
            # In place: `_retire`'s rename needs a new directory, which a full disk refuses.
            shutil.rmtree(path, ignore_errors=True)
        raise UserInputError(_disk_full_message(run_dir, step, keep)) from error
    barrier(engine.device)  # every rank's files are on disk before the marker says so
    if rank == 0:
        run_id = metadata.get("run_id")
        _write_marker(path, {"step": step, "time": time.time(), "run_id": run_id})
        _prune(run_dir, keep, run_id=run_id, step=step)
    barrier(engine.device)
    if rank != 0 and local_rank() == 0 and not os.path.exists(
            os.path.join(path, COMMIT_MARKER)):
        # This node does not see rank 0's marker: a run directory of its own, with --storage
        # (Ray Train's copy is the checkpoint; the launch refuses one without). Only rank 0
        # prunes the run's, so this node keeps its own parts of the newest `keep` saves.
        prune_node_copies(run_dir, keep, step)
    return path


# What DeepSpeed's global rank 0 copies into checkpoints/ at every ZeRO 1-3 save (its
# `_copy_recovery_script`): run as they stand they fail ("Unable to find 'latest' file":
# bertforge saves with save_latest=False), and with --tag they give a state dict in our
# parameter names, not a model anyone loads. No load reads them, the same scripts ship in
# the installed deepspeed (deepspeed/utils/), and `bertforge export` is the way out.
DEEPSPEED_RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def _remove_recovery_scripts(root: str) -> None:
    """Checkpoints/ holds step folders alone: the scripts beside them looked like the way to
    get weights out (and moved aside, pruned or uploaded with nothing)."""
    for name in DEEPSPEED_RECOVERY_SCRIPTS:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(root, name))


def _clear_step(path: str) -> None:
    """Remove what a step's folder holds before this run saves that step: the files of a save
    killed before its marker (a resume trains to the same step again), possibly written by
    more ranks than save now, and the universal conversion of an earlier save of the step.
    Saved over, the stale rank files stayed beside the new ones and the old conversion was
    loaded as the new save's: a resume on another number of workers read other weights."""
    for leftover in (path, universal_path(path)):
        if os.path.lexists(leftover):
            shutil.rmtree(leftover, ignore_errors=True)


# Less than this free after a failed save: the disk is what failed. torch.save reports a full
# disk as "[enforce fail at inline_container.cc] unexpected pos ...", with no errno.
_FULL_BELOW_BYTES = 16 * 2**20


def _disk_full(error: BaseException, directory: str) -> bool:
    if disk_full(error):
        return True
    try:
        return shutil.disk_usage(directory).free < _FULL_BELOW_BYTES
    except OSError:
        return False


def _disk_full_message(run_dir: str, step: int, keep: int) -> str:
    """What a run that filled its disk while saving says: where it can resume from and what
    makes room. (Retrying cannot: a restarted worker group trained to the same wall again.)"""
    newest = latest_checkpoint(run_dir)
    if newest is None:
        since = "no checkpoint of this run is committed yet"
    else:
        size = sum(os.path.getsize(os.path.join(folder, name))
                   for folder, _, names in os.walk(newest) for name in names)
        since = (f"the newest committed checkpoint, {newest}, is whole ({size / 2**20:,.0f} MiB; "
                 f"--keep-checkpoints {keep} keeps that many)")
    return (f"no space left on the disk of {run_dir} while saving the checkpoint of step "
            f"{step}; its partial files were removed and {since}: make room (or keep fewer "
            "checkpoints, or give a --run-dir with more space) and the same command resumes")


def prune_node_copies(run_dir: str, keep: int, step: int) -> None:
    """On a node whose run directory is its own: drop this node's parts of the saves older
    than its newest `keep` up to `step`. Rank 0 writes the commit markers on its node, so
    these parts have none; a checkpoint that has one (restored from storage, or a shared
    directory whose marker this node saw late) is never touched here."""
    root = checkpoints_root(run_dir)
    parts = sorted(int(m.group(1)) for name in os.listdir(root)
                   if (m := _TAG_PATTERN.match(name)) and int(m.group(1)) <= step
                   and not os.path.exists(os.path.join(root, name, COMMIT_MARKER)))
    for number in parts[:-keep]:
        _retire(os.path.join(root, tag_for_step(number)))
    for name in os.listdir(root):  # a removal killed part-way
        if name.startswith(_RETIRED_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load(engine, checkpoint_path: str, *, universal: bool = False,
         saved_world_size: int | None = None) -> dict[str, Any]:
    """Restore DeepSpeed state and this rank's RNG; returns the client_state.

    Collective. `universal`: the checkpoint was saved by another number of workers under ZeRO
    >= 1; it is converted once (convert_to_universal) and loaded through DeepSpeed's universal
    path, which re-shards the fp32 master weights and optimizer moments for this world size.
    The engine must have been built with `"checkpoint": {"load_universal": true}`.
    `saved_world_size` (bertforge.json's): each of its ranks must find its random state.
    """
    if not os.path.exists(os.path.join(checkpoint_path, COMMIT_MARKER)):
        raise ValueError(f"{checkpoint_path} is not a complete checkpoint (no {COMMIT_MARKER})")
    deepspeed_path = (
        convert_to_universal(checkpoint_path, device=engine.device) if universal
        else checkpoint_path
    )
    verify_safe_to_unpickle(deepspeed_path)
    root, tag = os.path.split(deepspeed_path.rstrip("/"))
    _, client_state = engine.load_checkpoint(root, tag=tag)
    if client_state is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint at {deepspeed_path}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_path = rng_file(checkpoint_path, rank)
    if os.path.exists(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=True))
    elif rank < (saved_world_size or 0):  # absent only for ranks more than saved
        raise _missing_rng_file(checkpoint_path, rank)
    return client_state


def rng_file(checkpoint_path: str, rank: int) -> str:
    return os.path.join(checkpoint_path, f"rng_rank_{rank:05d}.pt")


def _missing_rng_file(checkpoint_path: str, rank: int) -> UserInputError:
    """A saving rank's random state missing: `load` passed over it (as for a rank more than
    saved, which has none), and the resumed run drew other masks and dropout on that rank: no
    longer the uninterrupted run, without a word. Found where it is loaded: a node that keeps
    its own run directory holds only its ranks' files, so the driver cannot tell."""
    return UserInputError(
        f"{checkpoint_path} lacks {os.path.basename(rng_file(checkpoint_path, rank))}, the "
        f"random state of rank {rank}, which saved it (a copy that left files out?): a resume "
        "would not continue the run exactly. Restore the file, or remove the checkpoint's "
        f"{COMMIT_MARKER} to resume from the one before it")


def universal_path(checkpoint_path: str) -> str:
    """Where the universal form of a checkpoint lives: a sibling, step_00000300.universal."""
    return checkpoint_path.rstrip("/") + UNIVERSAL_SUFFIX


def convert_to_universal(checkpoint_path: str, *, device: torch.device | None = None) -> str:
    """Collective: the universal form of a ZeRO >= 1 checkpoint, made once; returns its path.

    One process per node converts (local rank 0, so each node's own disk has it when the run
    directory is not shared) while the others wait at the barrier. The conversion is written
    into a staging directory and renamed into place with its own commit marker, so a kill
    mid-way never leaves a half-written conversion that a later resume would load. Where two
    nodes share the disk, the second rename fails and its copy is dropped. `device`: the
    engine's, where the barrier runs under NCCL (training.distributed.barrier).
    """
    target = universal_path(checkpoint_path)
    if local_rank() == 0 and not _converted_since_committed(target, checkpoint_path):
        verify_safe_to_unpickle(checkpoint_path)  # the converter unpickles with weights_only=False
        root = os.path.dirname(target)
        staging = tempfile.mkdtemp(prefix=_UNIVERSAL_STAGING_PREFIX, dir=root)
        try:
            # Nested one level: the converter writes a `latest_universal` file beside its output.
            output = os.path.join(staging, os.path.basename(target))
            _run_ds_to_universal(checkpoint_path, output)
            _sync_files(output)
            _write_marker(output, {"source": os.path.basename(checkpoint_path),
                                   "time": time.time()})
            if not _converted_since_committed(target, checkpoint_path):
                # an uncommitted leftover, or the conversion of an earlier save of this step
                shutil.rmtree(target, ignore_errors=True)
            try:
                os.rename(output, target)
            except OSError:  # another node on the same disk published it first
                if not os.path.exists(os.path.join(target, COMMIT_MARKER)):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    barrier(device)
    if not os.path.exists(os.path.join(target, COMMIT_MARKER)):
        raise ValueError(f"the universal conversion of {checkpoint_path} is missing at {target}")
    return target


def _converted_since_committed(target: str, checkpoint_path: str) -> bool:
    """Whether `target` is a committed conversion of the checkpoint as it is now: made after
    the checkpoint's own commit (a step saved again, its folder's marker is newer)."""
    try:
        converted = _read_marker(target)["time"]
        committed = _read_marker(checkpoint_path).get("time", 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return converted >= committed


def _read_marker(path: str) -> dict[str, Any]:
    with open(os.path.join(path, COMMIT_MARKER), encoding="utf-8") as f:
        return json.load(f)


def _run_ds_to_universal(checkpoint_path: str, output: str) -> None:
    """DeepSpeed's ds_to_universal, in this process (its command line's defaults otherwise)."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(
        input_folder=checkpoint_path, output_folder=output,
        # No worker pools: forking a process that runs gloo's threads can deadlock; the work
        # is reading and writing files (0.3 s for the test's 2-layer model).
        num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True,
        # Our plain nn.Module declares no tensor-parallel patterns (Megatron models do); the
        # converter's own flag records the empty universal-checkpoint info it requires.
        inject_missing_state=True,
    )
    ds_to_universal.main(args)


def verify_safe_to_unpickle(checkpoint_path: str) -> None:
    """Refuse a checkpoint whose .pt files hold anything but tensors, plain data and DeepSpeed's
    few plain-data classes.

    DeepSpeed's own loaders call torch.load(weights_only=False), which would run whatever a
    tampered file asks for; each file must first pass torch's restricted unpickler (memory-
    mapped, so tensors are not read twice).
    """
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for path in _pt_files(checkpoint_path):
            _refuse_unless_zip(path)
            try:
                torch.load(path, weights_only=True, mmap=True, map_location="cpu")
            except pickle.UnpicklingError as error:
                raise UserInputError(
                    f"{path} holds objects outside the types a checkpoint may contain; "
                    f"refusing to load it ({_unpickler_verdict(error)})"
                ) from None
            except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as error:
                raise UserInputError(
                    f"{path} is truncated or damaged ({first_line(error)}); refusing to load it"
                ) from None


def _refuse_unless_zip(path: str) -> None:
    """torch.save has written zip archives since 1.6: anything else is refused before it is
    read. A zip's first bytes without its end record (the central directory, written last) is
    a file cut short: a copy or a save that did not finish."""
    if zipfile.is_zipfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(4)
    if not head or head.startswith(b"PK"):
        raise UserInputError(
            f"{path} is truncated or damaged ({os.path.getsize(path)} bytes, no zip end "
            "record: a copy or save cut short); refusing to load it"
        )
    # A legacy or raw pickle, which neither mmap nor the restricted unpickler should be given.
    raise UserInputError(
        f"{path} is not a torch zip checkpoint (a legacy or raw pickle); refusing to load it"
    )


def _unpickler_verdict(error: BaseException) -> str:
    """What torch's restricted unpickler refused ('Unsupported global: GLOBAL print'), without
    the advice around it, which tells how to load the file anyway."""
    match = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\.\s|$)",
                      str(error), flags=re.MULTILINE)
    return match.group(1).strip() if match else first_line(error)


def _pt_files(directory: str) -> list[str]:
    """Every .pt file below `directory` (a universal checkpoint nests one per parameter)."""
    paths = []
    for parent, _, names in os.walk(directory):
        paths.extend(os.path.join(parent, name) for name in names if name.endswith(".pt"))
    return sorted(paths)


def _deepspeed_safe_globals() -> list:
    """The non-tensor classes DeepSpeed pickles into ZeRO checkpoints: plain data holders.

    `getattr` is how pickle rebuilds an enum member (getattr(ZeroStageEnum, "gradients")),
    seen in multi-rank checkpoints. Allowing it only yields attributes: torch's restricted
    unpickler still calls nothing that is not on this list.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, getattr]


def read_metadata(checkpoint_path: str) -> dict[str, Any]:
    """The checkpoint's bertforge.json; a clear error when the path is no complete checkpoint."""
    if not os.path.exists(os.path.join(checkpoint_path, COMMIT_MARKER)):
        raise ValueError(f"{checkpoint_path} is not a complete checkpoint (no {COMMIT_MARKER})")
    path = os.path.join(checkpoint_path, METADATA_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise UserInputError(f"{path} is not valid JSON ({first_line(error)})") from None
    except FileNotFoundError:  # said "[Errno 2] No such file or directory" and nothing more
        raise UserInputError(f"checkpoint {checkpoint_path} lacks its {METADATA_NAME} (what "
                             "bertforge records of the run and its model): a checkpoint not "
                             "made by bertforge, or copied without it") from None
    if not isinstance(metadata, dict):
        raise UserInputError(f"{path} is not a bertforge checkpoint's metadata (not an object)")
    return metadata


def model_config_of(checkpoint_path: str, metadata: dict[str, Any] | None = None):
    """The BertConfig that a checkpoint's bertforge.json names, as a one-line user error when
    the file lacks it or holds fields no BertConfig has."""
    from bertforge.training.model import BertConfig

    metadata = read_metadata(checkpoint_path) if metadata is None else metadata
    path = os.path.join(checkpoint_path, METADATA_NAME)
    values = metadata.get("model_config")
    if not isinstance(values, dict):
        raise UserInputError(f"{path} has no model_config")
    try:
        return BertConfig.from_dict(values)
    except (TypeError, ValueError) as error:
        raise UserInputError(f"{path}: model_config is not a valid BertConfig "
                             f"({first_line(error)})") from None


def check_weights_match_config(checkpoint_path: str, metadata: dict[str, Any] | None = None):
    """Refuse a checkpoint whose bertforge.json disagrees with its weights (edited by hand, or
    copied from another run), naming the file, the parameter and both shapes. Reads shapes
    only: DeepSpeed's param_shapes (ZeRO >= 1), else the module's tensors, memory-mapped.
    Call verify_safe_to_unpickle first. Returns the config."""
    config = model_config_of(checkpoint_path, metadata)
    states_path, saved = _saved_shapes(checkpoint_path)
    _compare_shapes(checkpoint_path, config, saved, states_path)
    return config


def _saved_shapes(checkpoint_path: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    files = sorted(f for f in os.listdir(checkpoint_path) if f.endswith("model_states.pt"))
    if not files:
        raise UserInputError(f"{checkpoint_path} has no DeepSpeed model states "
                             "(*model_states.pt)")
    path = os.path.join(checkpoint_path, files[0])
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        blob = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    try:
        shapes = {name: tuple(shape) for group in blob.get("param_shapes") or ()
                  for name, shape in group.items()}
        if not shapes:  # ZeRO 0: the module's full tensors (under ZeRO-3 they are empty)
            shapes = {name: tuple(t.shape) for name, t in blob["module"].items()}
    except (KeyError, TypeError, AttributeError) as error:
        raise UserInputError(f"{path} is not DeepSpeed's model states (no parameter shapes: "
                             f"{type(error).__name__} {error})") from None
    return path, shapes


def _compare_shapes(checkpoint_path: str, config, saved: dict[str, tuple[int, ...]],
                    weights_name: str) -> None:
    """One line for the first parameter whose shape (or presence) differs from `config`'s."""
    from bertforge.training.model import BertForPreTraining

    with torch.device("meta"):
        expected = {name: tuple(t.shape)
                    for name, t in BertForPreTraining(config).state_dict().items()}
    config_path = os.path.join(checkpoint_path, METADATA_NAME)
    for name, shape in saved.items():
        if name in expected and expected[name] != shape:
            raise UserInputError(
                f"{config_path} does not match the checkpoint's weights: {name} is "
                f"{list(shape)} in {weights_name} but {list(expected[name])} by its model_config "
                "(edited, or copied from another run?)"
            )
    unexpected = [name for name in saved if name not in expected]
    with torch.device("meta"):
        parameters = [name for name, _ in BertForPreTraining(config).named_parameters()]
    missing = [name for name in parameters if name not in saved and name not in _TIED]
    if missing or unexpected:
        differences = ([f"{len(missing)} parameters of its model_config are not in the "
                        f"weights (first: {missing[0]})"] if missing else []) + (
            [f"{len(unexpected)} of the weights are not in its model_config (first: "
             f"{unexpected[0]})"] if unexpected else [])
        raise UserInputError(
            f"{config_path} does not match the checkpoint's weights in {weights_name}: "
            f"{'; '.join(differences)} (edited, or copied from another run?)"
        )


def holds_checkpoint(path: str) -> bool:
    """`path` is a complete checkpoint or a run directory with one."""
    return os.path.exists(os.path.join(path, COMMIT_MARKER)) or bool(committed_steps(path))


def resolve_checkpoint(path: str) -> str:
    """Accept a checkpoint directory or a run directory (then its newest complete checkpoint)."""
    if _UNIVERSAL_PATTERN.match(os.path.basename(os.path.normpath(path))):
        # It sits beside the checkpoints, and was read as one: "No such file ... bertforge.json".
        original = os.path.normpath(path)[: -len(UNIVERSAL_SUFFIX)]
        raise ValueError(f"{path} is DeepSpeed's universal copy of checkpoint {original}, made "
                         "to resume it on another number of workers: give that checkpoint, or "
                         "the run directory")
    if os.path.exists(os.path.join(path, COMMIT_MARKER)):
        return path
    pruned = pruned_checkpoint(path)
    if pruned is not None:
        raise UserInputError(pruned)
    latest = latest_checkpoint(path)
    if latest is None and run_marks(path):
        raise ValueError(no_checkpoint_yet(path))
    if latest is None:
        raise ValueError(f"{path} is neither a complete checkpoint nor a run with one")
    return latest


def run_marks(path: str) -> list[str]:
    """What shows `path` to be a training run's directory, with or without a checkpoint: its
    checkpoints folder, the metrics its first step writes (a run stopped before its first
    save has no checkpoints/), the driver's log its train writes first (a run still starting
    its workers, or stopped then, has nothing else); [] for any other folder."""
    return [name for name in (CHECKPOINTS_DIR, METRICS_NAME, TRAIN_LOG)
            if os.path.exists(os.path.join(path, name))]


def no_checkpoint_yet(path: str, flag: str | None = None) -> str:
    """What to say of a run directory without a complete checkpoint, given where a checkpoint
    was wanted; `flag` names the option that gave it (--init-from)."""
    named = f"{flag} {path} is a run directory with" if flag else f"run {path} has"
    return (f"{named} no complete checkpoint yet (a run before its first save, or stopped "
            "before it): wait for one (--checkpoint-every and --checkpoint-minutes set how "
            "often a run saves), or give another checkpoint")


def pruned_checkpoint(path: str) -> str | None:
    """What to say of a run's checkpoint that is gone (or going) while the run has newer ones:
    its train removed it, keeping its newest --keep-checkpoints. None for any other path."""
    parent = os.path.dirname(os.path.normpath(path))
    tag = _TAG_PATTERN.match(os.path.basename(os.path.normpath(path)))
    if tag is None or os.path.basename(parent) != CHECKPOINTS_DIR:
        return None
    run_dir = os.path.dirname(parent)
    steps = committed_steps(run_dir)
    if not steps or steps[-1] <= int(tag.group(1)):  # one being saved is not gone
        return None
    newest = os.path.join(parent, tag_for_step(steps[-1]))
    return (f"checkpoint {path} is no longer there: its run keeps only its newest "
            f"--keep-checkpoints (now {os.path.basename(newest)}); give the run directory "
            f"{run_dir} (its newest checkpoint) or a newer checkpoint")


def read_newest(path: str, read: Callable[[str], T]) -> tuple[str, T]:
    """(checkpoint, `read(checkpoint)`) for the complete checkpoint `path` names: itself, or a
    run directory's newest.

    A `bertforge train` still running in that run removes its older checkpoints after each
    save (--keep-checkpoints), so the one picked can go while it is read. For a run directory
    the newest is then picked again (`READ_TRIES` times); a checkpoint named by its own path
    that goes is a UserInputError saying so, not the missing file's error. A read that fails
    while its checkpoint is still there fails with its own error."""
    for _ in range(READ_TRIES):
        picked = resolve_checkpoint(path)
        try:
            return picked, read(picked)
        except Exception:
            if _still_committed(picked):
                raise
        if os.path.abspath(picked) == os.path.abspath(path):
            raise UserInputError(
                f"checkpoint {path} was removed while it was read: a bertforge train still "
                "running in its run keeps only its newest --keep-checkpoints; give the run "
                "directory (its newest checkpoint) or a newer checkpoint")
    raise UserInputError(
        f"the newest checkpoint of {path} was removed while it was read, {READ_TRIES} times: "
        "a bertforge train still running there saves faster than this reads; give it a "
        "larger --keep-checkpoints, or wait for it to end")


def _still_committed(path: str) -> bool:
    """Whether a checkpoint is still there, complete: its name listed in its directory (read
    afresh, where another NFS client's cached name may lag) and its marker present."""
    try:
        listed = os.path.basename(path) in os.listdir(os.path.dirname(path))
    except OSError:
        return False
    return listed and os.path.exists(os.path.join(path, COMMIT_MARKER))


def load_fp32_state_dict(checkpoint_path: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint of any ZeRO stage, without a DeepSpeed engine.

    Under ZeRO the fp32 master weights are partitioned across the ranks' optimizer files;
    DeepSpeed's own zero_to_fp32 reassembles them (bf16 module weights would lose precision).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, tag = os.path.split(checkpoint_path.rstrip("/"))
    if not os.path.exists(os.path.join(checkpoint_path, COMMIT_MARKER)):
        raise ValueError(f"{checkpoint_path} is not a complete checkpoint (no {COMMIT_MARKER})")
    verify_safe_to_unpickle(checkpoint_path)
    if _is_bf16_optimizer_checkpoint(checkpoint_path):
        state = _fp32_state_dict_from_bf16_optimizer(checkpoint_path)
    elif _is_zero_checkpoint(checkpoint_path):
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    else:  # ZeRO stage 0: the module states file holds the full weights
        files = [f for f in os.listdir(checkpoint_path) if f.endswith("model_states.pt")]
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            blob = torch.load(os.path.join(checkpoint_path, sorted(files)[0]), weights_only=True)
        state = blob["module"]
    return {name: tensor.float() for name, tensor in state.items()}


def _is_zero_checkpoint(checkpoint_path: str) -> bool:
    return any(name.endswith("_optim_states.pt") and "zero" in name
               for name in os.listdir(checkpoint_path))


_BF16_OPTIMIZER_FILE = re.compile(r"^bf16_zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def _bf16_optimizer_files(checkpoint_path: str) -> list[str]:
    """The per-rank optimizer files that bf16 engines write, in rank order."""
    ranked = [(int(m.group(1)), name) for name in os.listdir(checkpoint_path)
              if (m := _BF16_OPTIMIZER_FILE.match(name))]
    return [os.path.join(checkpoint_path, name) for _, name in sorted(ranked)]


_RANK_OPTIMIZER_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def missing_rank_files(checkpoint_path: str, metadata: dict[str, Any]) -> list[int]:
    """The ranks of the run's `world_size` whose optimizer file (ZeRO 1-3: a partition of the
    fp32 weights each) the checkpoint lacks: a multi-node run whose nodes kept their own run
    directories has only its node's here. [] for a checkpoint with no per-rank files."""
    ranks = {int(m.group(1)) for name in os.listdir(checkpoint_path)
             if (m := _RANK_OPTIMIZER_FILE.match(name))}
    world_size = metadata.get("world_size")
    if not ranks or not isinstance(world_size, int):
        return []
    return sorted(set(range(world_size)) - ranks)


def _is_bf16_optimizer_checkpoint(checkpoint_path: str) -> bool:
    """Saved by DeepSpeed's BF16_Optimizer (ZeRO-1 under bf16 with fp32 gradient
    accumulation, training.engine): its state names no ZeRO stage, unlike the ZeRO
    optimizers' files of the same name."""
    files = _bf16_optimizer_files(checkpoint_path)
    if not files:
        return False
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        blob = torch.load(files[0], weights_only=True, mmap=True, map_location="cpu")
    state = blob["optimizer_state_dict"]
    return "zero_stage" not in state and "param_slice_mappings" in state


def _fp32_state_dict_from_bf16_optimizer(checkpoint_path: str) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a BF16_Optimizer checkpoint, which zero_to_fp32 does not read.

    Each rank's file holds its flat fp32 partition of every parameter group and, per parameter,
    the (start, numel) of its fragment in that partition; the partitions are consecutive slices
    of the flat group, so a parameter is its fragments in rank order.
    """
    fragments: dict[str, list[torch.Tensor]] = {}
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        for path in _bf16_optimizer_files(checkpoint_path):
            blob = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
            optimizer_state = blob["optimizer_state_dict"]
            for partition, addresses in zip(optimizer_state["single_partition_of_fp32_groups"],
                                            optimizer_state["param_slice_mappings"], strict=True):
                for name, address in addresses.items():
                    fragment = partition.narrow(0, address.start, address.numel)
                    fragments.setdefault(name, []).append(fragment)
        files = [f for f in os.listdir(checkpoint_path) if f.endswith("model_states.pt")]
        model_states = torch.load(os.path.join(checkpoint_path, sorted(files)[0]),
                                  weights_only=True, mmap=True, map_location="cpu")
    state = {}
    for group in model_states["param_shapes"]:
        for name, shape in group.items():
            state[name] = torch.cat(fragments[name]).view(shape)
    for alias, source in model_states["shared_params"].items():  # the tied decoder
        state[alias] = state[source]
    return state


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sync_files(path: str) -> None:
    """fsync every file in a checkpoint's folder, and the folder. Each rank calls it once its
    own files are written, so each file is synced at least by its writer, whatever names
    DeepSpeed gives them. Without it a power loss could keep the commit marker and lose the
    files it vouches for (ext4 and XFS write a new file's data after its name): the resume
    then loaded empty files as the newest checkpoint. Syncing a file already on the disk costs
    a system call."""
    for folder, _, names in os.walk(path):
        for name in sorted(names):
            if not name.startswith(COMMIT_MARKER):
                with contextlib.suppress(FileNotFoundError):  # another rank's, renamed
                    fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def _write_marker(path: str, payload: dict[str, Any]) -> None:
    """The marker written whole and synced (an empty COMMITTED still counted as one), then its
    name, synced with its folder's."""
    tmp = os.path.join(path, COMMIT_MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, COMMIT_MARKER))
    fsync_path(path)


def _prune(run_dir: str, keep: int, *, run_id: str | None = None, step: int | None = None) -> None:
    """Keep the newest `keep` committed checkpoints of run `run_id` up to `step` (the save just
    committed; default the newest); drop its older ones and stale partial saves below `step`.

    A checkpoint of another run, or newer than `step`, is never deleted: pruning by step number
    alone once deleted a new run's saves because an old run's were numbered higher.
    Checkpoints saved before runs had ids belong to whichever run continues them.
    """
    steps = committed_steps(run_dir)
    if not steps:
        return
    step = steps[-1] if step is None else step
    root = checkpoints_root(run_dir)
    ours = [s for s in steps if s <= step and checkpoint_run_id(
        os.path.join(root, tag_for_step(s))) in (run_id, None)]
    drop = set(ours[:-keep])  # keep >= 1 (TrainConfig)
    committed = set(steps)
    for name in os.listdir(root):
        match = _TAG_PATTERN.match(name) or _UNIVERSAL_PATTERN.match(name)
        if match:
            number = int(match.group(1))
            # An uncommitted tag below `step` is a killed save: never a checkpoint.
            if number in drop or (number not in committed and number < step):
                _retire(os.path.join(root, name))
        elif name.startswith((_UNIVERSAL_STAGING_PREFIX,  # a conversion killed mid-way
                              _RETIRED_PREFIX)):  # a removal killed mid-way
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _retire(path: str) -> None:
    """Remove a checkpoint so that no reader (an export, an eval, a warm start beside the
    running train) ever finds it part-deleted: first renamed away from the step names in one
    atomic step, so a reader sees it whole or not at all, then its commit marker goes (another
    NFS client may still see the old name for a while: it then finds no marker), then the rest.
    Deleted in place, its marker could outlive its weights. Where a directory cannot be renamed
    (some FUSE mounts) or made (a full disk, which this removal is to relieve), the marker goes
    first and the rest in place."""
    target: str | None = path
    try:
        retired = tempfile.mkdtemp(prefix=_RETIRED_PREFIX, dir=os.path.dirname(path))
    except OSError:
        retired = None
    if retired is not None:
        try:
            os.rename(path, os.path.join(retired, os.path.basename(path)))
            target = os.path.join(retired, os.path.basename(path))
        except FileNotFoundError:
            target = None
        except OSError:
            pass  # in place
    if target is not None:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(target, COMMIT_MARKER))
        shutil.rmtree(target, ignore_errors=True)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def checkpoint_run_id(checkpoint_path: str) -> str | None:
    """The id of the run that saved a checkpoint (None: saved before runs had ids)."""
    try:
        with open(os.path.join(checkpoint_path, METADATA_NAME), encoding="utf-8") as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def new_run_id() -> str:
    """A run's id: the UTC time it started, to the millisecond: 20250301T142501.042Z."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def move_aside(run_dir: str) -> tuple[str, list[int]] | None:
    """A fresh start on a run directory with committed checkpoints: move them, with the run's
    metrics and config, to RUN_DIR/previous/<the old run's id>/ (the time of the move for
    checkpoints saved before runs had ids), a run directory of its own that `export`, `eval`
    and `--init-from` accept; returns (that path, the steps moved), or None when there was
    nothing to move."""
    steps = committed_steps(run_dir)
    if not steps:
        return None
    old_id = checkpoint_run_id(os.path.join(checkpoints_root(run_dir), tag_for_step(steps[-1])))
    name = old_id if old_id and re.fullmatch(r"[\w.-]+", old_id) else new_run_id()
    base = os.path.join(run_dir, PREVIOUS_DIR, name)
    target, n = base, 1
    while os.path.exists(target):  # two fresh starts within a second
        n += 1
        target = f"{base}-{n}"
    os.makedirs(target)
    for name in (CHECKPOINTS_DIR, *_RUN_FILES):
        if os.path.exists(os.path.join(run_dir, name)):
            os.rename(os.path.join(run_dir, name), os.path.join(target, name))
    return target, steps


def folder_bytes(path: str) -> int:
    """The bytes of every file under `path` (0 when it is gone)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def shown_bytes(count: int) -> str:
    """'153 MiB', '7.9 GiB': a size as a line shows it."""
    if count >= 2**30:
        return f"{count / 2**30:,.1f} GiB"
    return f"{count / 2**20:,.0f} MiB"


def moved_aside_line(run_dir: str, run_id: str, target: str, steps: list[int]) -> str:
    """What a fresh start says of the run it moved to RUN_DIR/previous/: where, and the disk it
    and every earlier run kept there hold. Each `--resume never` keeps one more run whole
    (BERT-large: ~4 GB a checkpoint), and nothing prunes previous/: a scheduler that restarts
    with it filled the disk unseen."""
    previous = os.path.dirname(target)
    runs = [name for name in os.listdir(previous) if os.path.isdir(os.path.join(previous, name))]
    held = sum(folder_bytes(os.path.join(previous, name)) for name in runs)
    line = (f"[train] new run {run_id} in {run_dir} (--resume never): the previous run's "
            f"{len(steps)} checkpoint(s) (steps {steps[0]}-{steps[-1]}), metrics and config are "
            f"kept in {target} ({shown_bytes(folder_bytes(target))}; export or --init-from it "
            "takes them)")
    if len(runs) > 1:
        line += (f"; {previous} holds {len(runs)} earlier runs, {shown_bytes(held)} in all: "
                 "delete those you no longer need")
    return line


def load_model(checkpoint_path: str):
    """An fp32 `BertForPreTraining` with the checkpoint's weights, and its metadata."""
    from bertforge.training.model import BertForPreTraining

    metadata = read_metadata(checkpoint_path)
    config = model_config_of(checkpoint_path, metadata)
    state = load_fp32_state_dict(checkpoint_path)
    # Before load_state_dict, whose 'size mismatch' is a many-line RuntimeError.
    _compare_shapes(checkpoint_path, config,
                    {name: tuple(t.shape) for name, t in state.items()}, "its weights")
    model = BertForPreTraining(config)
    model.load_state_dict(state, strict=False)
    return model, metadata


def positions_trained(metadata: dict[str, Any]) -> int:
    """The longest sequences the checkpoint's weights have trained position embeddings for
    (its run's data and, through resumes and warm starts, every run before it). Checkpoints
    saved before this was recorded: max_position_embeddings (their history is unknown)."""
    return int(metadata.get("positions_trained")
               or metadata["model_config"]["max_position_embeddings"])


def describe(checkpoint_path: str, metadata: dict[str, Any] | None = None) -> str:
    """'run 20250301T142501Z, step 300' (a checkpoint saved before runs had ids: 'step 300')."""
    metadata = read_metadata(checkpoint_path) if metadata is None else metadata
    run_id = metadata.get("run_id")
    step = f"step {metadata.get('global_step')}"
    return f"run {run_id}, {step}" if run_id else step
