"""One writer per dataset directory, never a dataset replaced by another unasked, never one
replaced under a run that reads it.

- `prepare` on a local OUTPUT takes OUTPUT/.lock (`run_lock`, as `train` does on its run
  directory): a second `prepare` into it fails at once, naming the first.
- A dataset already there (its manifest) that other inputs, vocabulary or instance parameters
  would replace is refused, naming what differs, unless `--overwrite` says to replace it. The
  same job again is allowed: it rewrites the same bytes.
- `train`, `eval` and `inspect` register as readers of their dataset for as long as they run
  (DATA/.readers/<token>/.lock, the same lock files; best effort: a read-only dataset cannot be
  replaced anyway). `prepare` refuses to touch a dataset with a live reader.
- A `prepare` that fails in a directory that did not exist (or was empty) before leaves nothing
  behind: no partial directory that looks like a dataset. Unless it left work to continue
  (OUTPUT/.prepare-work: stopped by a signal, a worker killed; `pipelines.local_job`): then the
  same command continues it. A failed rerun over an existing
  dataset leaves it without a manifest (the job removes it first), so it is never taken for
  complete.

Object storage outputs (gs://, s3://, Dataflow) are not locked here: Dataflow runs the job
elsewhere and the manifest, written last, is still what makes a dataset complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator

from bertforge.cluster.safety.run_lock import (
    LOCK_NAME,
    STALE_AFTER_SECONDS,
    Holder,
    RunDirectoryInUse,
    exclusive_directory,
    refuse_if_in_use,
)
from bertforge.pipelines.local.work_dir import WORK_DIR_NAME

READERS_DIR = ".readers"
OVERWRITE_FLAG = "--overwrite"


class DatasetConflict(ValueError):
    """The output holds another dataset, or a run reads it: a user error, one line."""


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


@contextlib.contextmanager
def writing_dataset(output: str, config, *, overwrite: bool) -> Iterator[None]:
    """Around a local `prepare` run: the lock, the identity check, the cleanup on failure."""
    if not is_local(output):
        yield
        return
    output = output.removeprefix("file://")
    refuse_a_training_run(output)
    cleaned = False
    try:
        with exclusive_directory(output, "prepare"):
            # Only once the lock is ours: what another prepare just made is not ours to clean
            # (looked at before, a prepare that ended meanwhile left a folder taken for empty,
            # and this run's refusal of its dataset deleted it).
            fresh = not _has_content(output)
            try:
                refuse_readers(output)
                if not overwrite:
                    refuse_another_dataset(output, config)
                yield
            except BaseException:
                # Work a rerun continues (a stop, a worker killed) stays, and with it the
                # pieces written so far; a failure the job reported took its work away.
                if fresh and not os.path.isdir(os.path.join(output, WORK_DIR_NAME)):
                    remove_all_but_the_lock(output)
                    cleaned = True
                raise
    finally:
        if cleaned:  # the lock is released now: the folder goes too, if nobody wrote since
            with contextlib.suppress(OSError):
                os.rmdir(output)


def refuse_a_training_run(output: str) -> None:
    """A run directory given as --output took the dataset's files beside its checkpoints
    without a word (and --overwrite, which clears the folder first, would have taken them)."""
    from bertforge.training.checkpoint import run_marks

    marks = run_marks(output)
    if marks:
        raise DatasetConflict(f"--output {output} holds a training run ({', '.join(marks)}): "
                              "give the dataset a folder of its own")


def remove_all_but_the_lock(output: str) -> None:
    """Everything the failed job wrote; the lock goes when it is released, then the folder."""
    for name in os.listdir(output):
        if name != LOCK_NAME:
            path = os.path.join(output, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def _has_content(output: str) -> bool:
    return any(name not in (LOCK_NAME, "logs") for name in os.listdir(output))


def refuse_another_dataset(output: str, config) -> None:
    refuse_another_vocabulary(output, config.vocab)
    differences = differences_from_dataset(output, config)
    if differences:
        raise DatasetConflict(
            f"{output} holds a dataset made from other inputs or settings (differs in: "
            f"{'; '.join(differences)}); use another --output, or add {OVERWRITE_FLAG} to "
            "replace it")


def refuse_another_vocabulary(output: str, vocab: str) -> None:
    """A vocab.txt in an output that holds no dataset is not a dataset's copy: most likely a
    `bertforge vocab` output, whose datasets read their ids by it. prepare writes its own
    vocabulary there, so one of other tokens is refused (a dataset's copy is compared with
    the dataset's identity)."""
    from bertforge.pipelines.contract.manifest import MANIFEST_NAME, VOCAB_NAME
    from bertforge.pipelines.filesystem import sha256_of

    there = os.path.join(output, VOCAB_NAME)
    if os.path.isfile(os.path.join(output, MANIFEST_NAME)) or not os.path.isfile(there):
        return
    try:
        if sha256_of(there) == sha256_of(vocab):
            return
    except OSError:
        return  # an unreadable --vocab: the job's own check names it
    raise DatasetConflict(
        f"{there} holds another vocabulary than --vocab {vocab}, and {output} holds no dataset: "
        f"prepare would write --vocab over it; use another --output, or add {OVERWRITE_FLAG} "
        "to replace it")


def differences_from_dataset(output: str, config, *, inputs_may_be_gone: bool = False,
                             moved: tuple[str, str] | None = None) -> list[str]:
    """How the dataset in `output` differs from the one `config` would make from its inputs as
    they are now (`pipelines.dataset_identity`); [] when it is the same or there is none.
    `inputs_may_be_gone`: input files deleted since (the corpus removed once its shards were
    made) are no difference, and a pattern that matches nothing any more is none either; a file
    edited or added still is. `moved`: (from, to), a folder moved whole with the inputs and the
    dataset since (`dataset_identity.dataset_differences`)."""
    from bertforge.pipelines.contract.manifest import MANIFEST_NAME, read_manifest
    from bertforge.pipelines.dataset_identity import dataset_differences
    from bertforge.pipelines.filesystem import sha256_of, sizes_of
    from bertforge.pipelines.read.inputs_transform import match_inputs

    if not os.path.isfile(os.path.join(output, MANIFEST_NAME)):
        return []
    try:
        found = read_manifest(output)
    except (ValueError, KeyError, OSError):
        return []  # not a readable dataset: nothing to protect
    # Quiet: the job's own walk of the same inputs says what it leaves out (a continued
    # prepare said each "leaving out" twice).
    if inputs_may_be_gone:
        matched = []
        for pattern in config.inputs:
            with contextlib.suppress(ValueError):  # matches nothing now
                matched += match_inputs((pattern,), output, config.vocab, quiet=True)
    else:
        matched = match_inputs(config.inputs, output, config.vocab, quiet=True)
    paths = [path for path, _ in matched]
    return dataset_differences(found, config, paths, sha256_of(config.vocab), sizes_of(paths),
                               gone_is_a_difference=not inputs_may_be_gone, moved=moved,
                               forced_formats=dict(matched))


def live_readers(data_dir: str) -> list[Holder]:
    """The runs reading `data_dir` now; the records of readers that are gone are removed."""
    root = os.path.join(data_dir, READERS_DIR)
    live = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        record = os.path.join(root, name)
        try:
            with open(os.path.join(record, LOCK_NAME), encoding="utf-8") as f:
                holder = Holder.parse(f.read())
        except OSError:
            holder = None
        if holder is not None and holder.is_alive(STALE_AFTER_SECONDS):
            live.append(holder)
        elif holder is not None or _age(record) >= STALE_AFTER_SECONDS:
            shutil.rmtree(record, ignore_errors=True)
        # else a reader's record being made (its lock file not in it yet), left to it: removed,
        # the reader's lock failed and it read on unrecorded, or failed naming the record. It
        # looks for this prepare's lock once recorded (`refuse_a_writer`).
    return live


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def refuse_readers(data_dir: str) -> None:
    readers = live_readers(data_dir)
    if readers:
        raise DatasetConflict(
            f"{data_dir} is being read by a bertforge {readers[0].command} "
            f"({readers[0].describe()}); wait for it to end or write to another --output")


@contextlib.contextmanager
def reading_dataset(data_dir: str, command: str) -> Iterator[None]:
    """While a run reads `data_dir`: a live reader's record that `prepare` respects."""
    if not is_local(data_dir):
        yield
        return
    record = os.path.join(data_dir.removeprefix("file://"), READERS_DIR, uuid.uuid4().hex)
    try:
        _make_record_folder(record)
        lock = exclusive_directory(record, command)
        lock.__enter__()
    except (OSError, RunDirectoryInUse):
        refuse_a_writer(data_dir.removeprefix("file://"))
        yield  # a read-only dataset: nobody can replace it under us
        return
    try:
        refuse_a_writer(data_dir.removeprefix("file://"))
        yield
    finally:
        lock.__exit__(None, None, None)
        shutil.rmtree(record, ignore_errors=True)
        with contextlib.suppress(OSError):  # the last reader leaves no empty folder behind
            os.rmdir(os.path.dirname(record))


def _make_record_folder(record: str) -> None:
    """DATA/.readers/<token>, made again where the last reader, ending, removed the empty
    DATA/.readers between its look and its making (the run failed: "cannot write the run lock
    in DATA/.readers/...: No such file or directory"). Made here, not by the lock: a folder
    this user may only read raises the OS's error, on which the run reads unrecorded (the
    lock turned it into "cannot write the run lock", and the run failed)."""
    for attempt in range(5):
        try:
            os.makedirs(record)
            return
        except FileNotFoundError:
            if attempt == 4:
                raise


def refuse_a_writer(data_dir: str) -> None:
    """A `prepare` writing `data_dir` now (its lock, DATA/.lock) is past its look for readers:
    a run that reads it meanwhile had its shards rewritten or deleted under it. Looked at once
    this reader is recorded, as `prepare` looks for readers once its lock is taken: of two
    that start together, one sees the other."""
    try:
        refuse_if_in_use(data_dir)
    except RunDirectoryInUse:
        holder = Holder.parse(_lock_text(data_dir) or "")
        raise DatasetConflict(
            f"{data_dir} is being written by a bertforge prepare"
            f"{f' ({holder.describe()})' if holder else ''}: wait for it to end, or read "
            "another dataset") from None


def _lock_text(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, LOCK_NAME), encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None
