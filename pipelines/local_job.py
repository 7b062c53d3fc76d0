"""`prepare` on the local runner: where its work lives, what makes a rerun the same job, what its
progress line says, and what a failure leaves behind.

The work (`pipelines.local`) lives in OUTPUT/.prepare-work, beside the dataset it becomes, on the
disk the user chose for it. A killed run (kill -9, Ctrl-C, a reboot, a worker killed for memory)
leaves it there and the same command continues it; a rerun with other inputs, vocabulary,
instance parameters, bundle size or code is refused until `--overwrite` starts over. On success
the work directory and every temporary shard piece are removed; on a failure the job itself
reports (bad input, a full disk) they are removed too, since a rerun would fail the same way,
and so is everything else the run wrote when the output held nothing before it
(`files_before`); files it held before are left.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import os
import re
import shutil
from collections import Counter

from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from bertforge.pipelines.beam_common import JOB_REFUSALS, METRICS_NAMESPACE
from bertforge.pipelines.contract import manifest
from bertforge.pipelines.contract.disk_space import exception_chain, fullest_of, nearest_existing
from bertforge.pipelines.local.options import (
    LocalRunnerOptions,
    bundle_bytes,
    progress_seconds,
)
from bertforge.pipelines.local.progress import Progress, format_size
from bertforge.pipelines.local.runner import LocalRunner
from bertforge.pipelines.local.work_dir import WORK_DIR_NAME, WorkConflict
from bertforge.pipelines.local.worker_records import relay_our_worker_records
from bertforge.pipelines.prepare_options import PrepareConfig
from bertforge.pipelines.read.readers import input_location

logger = logging.getLogger(__name__)

# What a piece or a shard is called while it is written (`shards_transform`): left by a killed run.
TEMPORARY_SHARD_FILES = ("*/*.arrow.piece*.tmp", "*/*.arrow.tmp-*")


def local_runner(config: PrepareConfig, options: PipelineOptions, files: list,
                 vocab_bytes: bytes, start_over: bool) -> LocalRunner:
    local = "://" not in config.output or config.output.startswith("file://")
    output = config.output.removeprefix("file://")
    relay_our_worker_records()  # multi_processing's workers: their warnings as ours
    return LocalRunner(
        work_dir=os.path.join(output, WORK_DIR_NAME) if local else None,
        identity=job_identity(config, files, vocab_bytes),
        start_over=start_over,
        max_bundle_bytes=bundle_bytes(options),
        progress=Progress(
            enabled=not options.view_as(LocalRunnerOptions).quiet,
            namespace=METRICS_NAMESPACE,
            describe=describe_counters,
            interval=progress_seconds(options),
            prefix="prepare: ",
        ),
    )


def job_identity(config: PrepareConfig, files: list, vocab_bytes: bytes) -> dict:
    """What two runs must share for one to continue the other's work."""
    return {
        **config.instance_params(),  # one key each: a difference names the parameter
        "vocab_sha256": hashlib.sha256(vocab_bytes).hexdigest(),
        # Where the files are, however they were spelled: the same command from another
        # working directory continues the work.
        "inputs": [[input_location(path), *_size_and_time(path)] for path, _ in files],
        "formats": [forced for _, forced in files],
        "code": code_digest(),
    }


def _size_and_time(path: str) -> tuple[int, float]:
    metadata = FileSystems.match([path])[0].metadata_list[0]
    return metadata.size_in_bytes, metadata.last_updated_in_seconds


def code_digest() -> str:
    """Of the job's code (this package's sources): another version may cut or label differently."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def describe_counters(counters: Counter) -> str:
    """The job's counters in a progress line (summed over the bundles done so far); nothing
    until a first document is read (not "0 documents (0 MB) read")."""
    if not counters["input_documents"]:
        return ""
    read = format_size(counters["input_bytes"], 0.5e6, ",.0f")
    return (f"{counters['input_documents']:,} documents ({read}) read, "
            f"{counters['documents']:,} kept, {counters['instances']:,} instances")


def after_success(runner, output: str) -> None:
    """Temporary shard pieces a killed bundle left (a redone bundle writes its own) are removed;
    so are the shards of the dataset this one replaced (`--overwrite`) that the new manifest
    does not list (another --num-shards names them differently)."""
    if isinstance(runner, LocalRunner) and "://" not in output:
        _remove_temporary_shard_files(output)
        if os.path.isfile(os.path.join(output, manifest.MANIFEST_NAME)):
            for path in manifest.unlisted_shard_files(output, manifest.read_manifest(output)):
                os.remove(os.path.join(output, path))


# In a local output, what is not a dataset's file: the command's logs, and the dot-names
# (the run lock, readers' records, the work directory).
NOT_DATASET_FILES = ("logs",)


def files_before(output: str) -> list[str]:
    """The names a local output holds before a run writes to it (an earlier dataset, a killed
    run's shards, a user's files), but its logs and dot-names: what a failed run leaves there
    (`after_failure`). [] for a folder that is not there yet, or in object storage."""
    if _is_remote(output):
        return []
    try:
        names = os.listdir(output.removeprefix("file://"))
    except OSError:
        return []
    return sorted(name for name in names
                  if name not in NOT_DATASET_FILES and not name.startswith("."))


def _remove_temporary_shard_files(output: str) -> None:
    for pattern in TEMPORARY_SHARD_FILES:
        for path in glob.glob(os.path.join(output, pattern)):
            os.remove(path)


def drop_a_finished_runs_leftovers(output: str) -> None:
    """What a run killed after its manifest and before its own clean-up (`after_success`, the
    runner's discard of its work) left in a local output: its work record and temporary shard
    pieces. Every run removes the manifest before it opens its work record, so a manifest
    beside one was written by that record's run, which had finished: the record is no work to
    continue. Continued, every bundle was reused, the manifest's step among them, after the
    manifest was removed: the next prepare failed with "manifest.json not found" and the
    dataset was lost."""
    if _is_remote(output):
        return
    output = output.removeprefix("file://")
    if os.path.isfile(os.path.join(output, manifest.MANIFEST_NAME)):
        shutil.rmtree(os.path.join(output, WORK_DIR_NAME), ignore_errors=True)
        _remove_temporary_shard_files(output)


def after_failure(runner, error: Exception, output: str, earlier: list[str]) -> None:
    """Keep the work for a rerun, unless the rerun would fail the same way; raise what to say.
    `earlier`: what the output held before this run (`files_before`), left there; when it held
    nothing, everything this run wrote goes with its work."""
    if not isinstance(runner, LocalRunner) or runner.work is None:
        return
    if isinstance(error, WorkConflict):
        raise WorkConflict(f"{error}: run the same command as before to continue it, or add "
                           "--overwrite to start over") from error
    full = _is_disk_full(error)
    if full or any(words in str(error) for words in JOB_REFUSALS) or isinstance(error, ValueError):
        where = _full_folder(error, output, runner.work.root) if full else output
        runner.work.discard()
        after_success(runner, output)
        if not earlier and not _is_remote(output):
            _remove_what_the_run_wrote(output.removeprefix("file://"))
        if full:
            raise OSError(errno.ENOSPC, _disk_full_message(where, output, earlier)) from error
        return
    logger.error("prepare failed; its work is kept in %s: the same command continues it",
                 runner.work.root)


def _is_remote(output: str) -> bool:
    return "://" in output and not output.startswith("file://")


def _remove_what_the_run_wrote(output: str) -> None:
    """An output that held nothing before the run: whatever is in it now is the run's (shards
    it finished, the split folders), but the logs and the lock."""
    for name in files_before(output):
        path = os.path.join(output, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


def _is_disk_full(error: BaseException) -> bool:
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or \
        "No space left on device" in str(error)


def _disk_full_message(where: str, output: str, earlier: list[str]) -> str:
    if where == output:
        return (f"no space left on the disk of {output} (the dataset and its work directory "
                f"{WORK_DIR_NAME}): free space or choose another --output; "
                f"{_what_was_kept(output, earlier)}")
    return (f"no space left on the disk of {where}, where prepare wrote (not the disk of "
            f"--output {output}): free space there; {_what_was_kept(output, earlier)}")


def _what_was_kept(output: str, earlier: list[str]) -> str:
    """It said "nothing of this run was kept" of a folder that held files before the run,
    which were left there, and with them any shard this run had finished."""
    if _is_remote(output):
        return "its temporary work was removed"
    if not earlier:
        return "nothing of this run was kept"
    # The job removes a dataset's manifest as it starts: incomplete until a run ends.
    no_dataset = (" (without its manifest.json: no dataset)"
                  if manifest.MANIFEST_NAME in earlier else "")
    return (f"its work directory and temporary files were removed; the files {output} held "
            f"before this run were left{no_dataset}, with any shard this run had finished")


# What the OS says of a full disk when Beam passes an error on as text (from a worker process).
_FULL_FILE_IN_TEXT = re.compile(r"No space left on device: '(/[^']+)'")


def _full_folder(error: BaseException, output: str, work_root: str) -> str:
    """The folder whose disk filled: `output` when that is its disk (it said so of every full
    disk, a split folder mounted elsewhere or the temporary work of a remote --output too).
    The file the error names, where it names one (errno's filename); else, as pyarrow's
    writes name none, the fullest of the folders the job writes into (the output and its
    folders; for a remote output, its work in the temporary directory)."""
    named = _named_file(error)
    if "://" in output:  # object storage does not fill: the work or the temporary directory
        return os.path.dirname(named) if named else work_root
    # Not the temporary directory: a local job writes nothing there (tried with TMPDIR on a
    # full disk), and a fuller one would be named for the output's.
    candidates = [os.path.dirname(named)] if named else \
        [output, *_folders_in(output), work_root]
    fullest = fullest_of(*candidates)  # the output first: it wins a tie
    return output if _device(fullest) == _device(output) else fullest


def _named_file(error: BaseException) -> str | None:
    for seen in exception_chain(error):
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC and seen.filename \
                and os.path.isabs(str(seen.filename)):
            return str(seen.filename)
        found = _FULL_FILE_IN_TEXT.search(str(seen))
        if found:
            return found.group(1)
    return None


def _folders_in(output: str) -> list[str]:
    """The split folders and the work directory: any may be a mount of its own."""
    try:
        names = sorted(os.listdir(output))
    except OSError:
        return []
    return [os.path.join(output, name) for name in names
            if os.path.isdir(os.path.join(output, name))]


def _device(path: str) -> int | None:
    try:
        return os.stat(nearest_existing(path)).st_dev
    except OSError:
        return None
