"""What a failed local `prepare` leaves and says (`pipelines.local_job`), without running a job."""

from __future__ import annotations

import errno
import os

import pytest

from bertforge.pipelines.local.runner import LocalRunner
from bertforge.pipelines.local.work_dir import WorkDir
from bertforge.pipelines.local_job import (
    after_failure,
    drop_a_finished_runs_leftovers,
    files_before,
)


def _runner_with_work(tmp_path) -> LocalRunner:
    runner = LocalRunner(work_dir=str(tmp_path / "out" / ".prepare-work"))
    runner.work = WorkDir(runner._work_dir, {"job": 1})
    runner.work.open()
    (tmp_path / "out" / "train").mkdir()
    (tmp_path / "out" / "train" / "part-00000-of-00001.arrow.piece0-ab12.tmp").write_bytes(b"x")
    return runner


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("Traceback ... OSError: [Errno 28] No space left on device: 'train/x.tmp'"),
])
def test_a_full_disk_is_one_error_naming_the_directory_and_nothing_is_kept(tmp_path, error):
    runner = _runner_with_work(tmp_path)
    output = str(tmp_path / "out")
    (tmp_path / "out" / "train" / "part-00001-of-00002.arrow").write_bytes(b"a finished shard")
    (tmp_path / "out" / ".lock").write_text("its lock")
    with pytest.raises(OSError, match=f"no space left on the disk of {output}") as raised:
        after_failure(runner, error, output, earlier=[])
    assert raised.value.errno == errno.ENOSPC
    assert str(raised.value.strerror).endswith("; nothing of this run was kept")
    # The lock is its holder's to remove (with the folder, by `bertforge prepare`'s guard).
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == [".lock"]


def test_a_full_disk_in_a_folder_that_held_files_says_they_were_left(tmp_path):
    """Into a folder holding an earlier dataset, whose files the failed run left there (the
    job removed its manifest as it started), it said "nothing of this run was kept"."""
    output = tmp_path / "out"
    output.mkdir()
    for name in ("vocab.txt", "rejects.jsonl", "manifest.json"):
        (output / name).write_text("an earlier dataset's")
    earlier = files_before(str(output))
    assert earlier == ["manifest.json", "rejects.jsonl", "vocab.txt"]
    (output / "manifest.json").unlink()  # as the job does as it starts
    runner = _runner_with_work(tmp_path)
    with pytest.raises(OSError) as raised:
        after_failure(runner, OSError(errno.ENOSPC, "No space left on device"), str(output),
                      earlier)
    assert raised.value.strerror == (
        f"no space left on the disk of {output} (the dataset and its work directory "
        ".prepare-work): free space or choose another --output; its work directory and "
        f"temporary files were removed; the files {output} held before this run were left "
        "(without its manifest.json: no dataset), with any shard this run had finished")
    assert sorted(p.name for p in output.rglob("*")) == ["rejects.jsonl", "train", "vocab.txt"]


def _on_disks(monkeypatch, full: str):
    """`full` (a folder) on a disk of its own with no room left; the rest on one with room."""
    from bertforge.pipelines import local_job
    from bertforge.pipelines.contract import disk_space

    def on_full(path):
        return os.path.abspath(path).startswith(full)

    monkeypatch.setattr(local_job, "_device", lambda path: 2 if on_full(path) else 1,
                        raising=False)  # (the code before had none)
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 0 if on_full(path) else 2**40)


def test_a_full_split_folder_mounted_elsewhere_is_the_disk_named(tmp_path, monkeypatch):
    """pyarrow's ENOSPC names no file, and every full disk was said to be --output's: with
    OUTPUT/train on a disk of its own (a tmpfs here, by hand), "free space or choose another
    --output" of a disk that had room."""
    runner = _runner_with_work(tmp_path)
    output = str(tmp_path / "out")
    _on_disks(monkeypatch, full=os.path.join(output, "train"))
    with pytest.raises(OSError, match=rf"^\[Errno 28\] no space left on the disk of "
                       rf"{output}/train, where prepare wrote \(not the disk of --output "
                       rf"{output}\): free space there"):
        after_failure(runner, OSError(errno.ENOSPC, "No space left on device"), output, [])


@pytest.mark.parametrize("as_text", [False, True])
def test_a_full_disk_the_error_names_is_the_disk_named(tmp_path, monkeypatch, as_text):
    """errno's filename, or the OS's words as Beam passes on a worker's error as text."""
    runner = _runner_with_work(tmp_path)
    output = str(tmp_path / "out")
    elsewhere = str(tmp_path / "elsewhere")
    _on_disks(monkeypatch, full=elsewhere)
    error = OSError(errno.ENOSPC, "No space left on device", f"{elsewhere}/spill.bin")
    if as_text:
        error = RuntimeError(f"Traceback ... OSError: {error}")
    with pytest.raises(OSError, match=f"no space left on the disk of {elsewhere}, where "):
        after_failure(runner, error, output, [])


def test_a_full_temporary_work_of_a_remote_output_is_not_said_of_the_bucket(tmp_path):
    """A local job into gs://... works in the temporary directory: its full disk was said to
    be the bucket's ("no space left on the disk of gs://b/shards")."""
    runner = LocalRunner(work_dir=None)
    runner.work = WorkDir(str(tmp_path / "bertforge-work-x"), {"job": 1})
    runner.work.open()
    with pytest.raises(OSError, match=f"no space left on the disk of {tmp_path}/bertforge-work-x/s"
                       r", where prepare wrote \(not the disk of --output gs://b/shards\)"):
        after_failure(runner, OSError(errno.ENOSPC, "No space left on device",
                                      str(tmp_path / "bertforge-work-x" / "s" / "b1.run")),
                      "gs://b/shards", [])


def test_a_full_disk_error_that_is_its_own_cause_is_named_not_walked_for_ever(tmp_path):
    """`raise e from e` (Ray does it) makes a chain that loops."""
    runner = _runner_with_work(tmp_path)
    output = str(tmp_path / "out")
    error = RuntimeError("No space left on device")
    error.__cause__ = error
    with pytest.raises(OSError, match=f"no space left on the disk of {output} "):
        after_failure(runner, error, output, [])


def test_a_failure_a_rerun_can_continue_keeps_the_work(tmp_path, caplog):
    runner = _runner_with_work(tmp_path)
    after_failure(runner, RuntimeError("SDK worker exited with -9"), str(tmp_path / "out"), [])
    assert (tmp_path / "out" / ".prepare-work" / "job.json").exists()
    assert "the same command continues it" in caplog.text


def test_a_failure_the_job_reports_takes_the_work_away(tmp_path):
    runner = _runner_with_work(tmp_path)
    after_failure(runner, ValueError("no usable document remains"), str(tmp_path / "out"), [])
    assert not (tmp_path / "out" / ".prepare-work").exists()
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_a_work_record_beside_a_manifest_is_a_finished_runs_and_goes(tmp_path):
    """Every run removes the manifest before it opens its work record: a record beside one is
    left by a run killed after its manifest, and continued, the job reused its manifest's step
    after removing the manifest (`python -m bertforge.pipelines.prepare` failed, the dataset
    lost). Without a manifest it is work to continue, and stays."""
    runner = _runner_with_work(tmp_path)
    output = tmp_path / "out"
    drop_a_finished_runs_leftovers(str(output))
    assert (output / ".prepare-work" / "job.json").exists()
    assert list(output.rglob("*.tmp"))
    (output / "manifest.json").write_text("{}")
    drop_a_finished_runs_leftovers(str(output))
    assert not os.path.exists(runner.work.root) and not list(output.rglob("*.tmp"))
    assert (output / "manifest.json").exists()


def test_progress_lines_say_nothing_of_zero_megabytes_or_documents():
    """A stage whose input is not sized yet, before any document is read: how long it has run,
    not '0% of 0.0 MB in 9 s; 0 documents (0 MB) read' (issue 35)."""
    from collections import Counter

    from bertforge.pipelines.local.progress import Progress
    from bertforge.pipelines.local_job import describe_counters

    progress = Progress(False, describe=describe_counters, prefix="prepare: ")
    progress.stage_started("ReadInputs", 0, 36)
    assert progress.line().startswith("prepare: ReadInputs (stage 1 of 36), 0 s in this stage; ")
    assert "MB" not in progress.line() and "documents" not in progress.line()
    progress.stage_started("TokenizeParts", 2_000_000, 36)
    progress.counters.update(Counter(input_documents=3, input_bytes=1_500_000, documents=3,
                                     instances=10))
    assert "0% of 2.0 MB in 0 s; 3 documents (2 MB) read, 3 kept, 10 instances; " \
        in progress.line()
    # Small ones in kB: never "0.0 MB" nor "(0 MB) read".
    progress.stage_started("StatsDict", 30_000, 36)
    progress.counters.update(Counter(input_bytes=-1_490_000))  # 10 kB read in all
    assert "0% of 30 kB in 0 s; 3 documents (10 kB) read, " in progress.line()
