"""One writer per dataset directory (`bertforge prepare` through the CLI, the real Beam job):
another dataset is not replaced unasked, none is replaced under a run that reads it, a second
prepare is refused at once, and a failed first prepare leaves no directory behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.safety.dataset_guard import reading_dataset
from bertforge.cluster.safety.run_lock import exclusive_directory
from bertforge.pipelines.local.quiet_harness import QUIET_HARNESS_MODULE
from tests.test_numbers_unchanged import _golden_corpus
from tests.training.conftest import google_layout_vocab

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    _golden_corpus(str(root / "corpus.jsonl"))
    (root / "vocab.txt").write_text("\n".join(google_layout_vocab()) + "\n", encoding="utf-8")
    (root / "empty.jsonl").write_text("", encoding="utf-8")
    return root


def prepare(inputs, output, *flags, corpus="corpus.jsonl") -> int:
    return main(["prepare", f"--input={inputs / corpus}", f"--output={output}",
                 f"--vocab={inputs / 'vocab.txt'}", "--max-seq-length=48", "--num-shards=2",
                 *flags])


def manifest_bytes(output) -> bytes:
    return (output / "manifest.json").read_bytes()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_another_dataset_is_refused_unless_asked_and_the_same_job_runs_again(
    inputs, tmp_path, capsys, monkeypatch
):
    output = tmp_path / "shards"
    assert prepare(inputs, output) == 0
    first = manifest_bytes(output)
    capsys.readouterr()

    assert prepare(inputs, output, "--dupe-factor=2", "--seed=7") == 2
    line = one_error_line(capsys)
    assert (f"{output} holds a dataset made from other inputs or settings (differs in: "
            "dupe_factor 1 -> 2; seed 12345 -> 7)") in line and "--overwrite" in line
    assert manifest_bytes(output) == first  # untouched

    # The same job: nothing to do (it deleted the manifest, redid every shard, and a kill
    # meanwhile lost the dataset), unless a shard is gone: then it is made again, the same.
    stamp = os.stat(output / "manifest.json").st_mtime_ns
    assert prepare(inputs, output) == 0
    said = capsys.readouterr()
    assert f"[prepare] {output} already holds this dataset" in said.err
    assert json.loads(said.out)["unchanged"] is True  # stdout: the summary's JSON alone
    assert os.stat(output / "manifest.json").st_mtime_ns == stamp
    assert prepare(inputs, output, "--quiet") == 0  # the summary alone
    assert json.loads(capsys.readouterr().out)["unchanged"] is True
    shard = next((output / "train").glob("*.arrow"))
    shard.unlink()
    assert prepare(inputs, output) == 0
    assert "already holds" not in capsys.readouterr().out
    assert shard.exists() and manifest_bytes(output) == first

    # Another shard count: the old shards go before the new manifest is written. (They went
    # after the job, so a kill just after the manifest left them beside a complete dataset:
    # `inspect --verify` failed on each. That kill: no cleanup after the job.)
    with monkeypatch.context() as patched:
        from bertforge.pipelines import local_job

        patched.setattr(local_job, "after_success", lambda runner, output: None)
        assert prepare(inputs, output, "--dupe-factor=2", "--num-shards=3", "--overwrite") == 0
    assert json.loads(manifest_bytes(output))["instance_params"]["dupe_factor"] == 2
    assert sorted(path.name for path in (output / "train").glob("*.arrow")) == [
        f"part-0000{i}-of-00003.arrow" for i in range(3)]

    # The same command after the corpus grew: another dataset (its input's size is not the
    # one recorded), refused as such; it was replaced without a word.
    grown = tmp_path / "grown"
    grown.mkdir()
    (grown / "corpus.jsonl").write_bytes((inputs / "corpus.jsonl").read_bytes())
    (grown / "vocab.txt").write_bytes((inputs / "vocab.txt").read_bytes())
    assert prepare(grown, tmp_path / "again") == 0
    again = manifest_bytes(tmp_path / "again")
    with open(grown / "corpus.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "One more document. It has two sentences."}) + "\n")
    assert prepare(grown, tmp_path / "again") == 2
    line = one_error_line(capsys)
    assert f"the input files' content (another size: {grown / 'corpus.jsonl'})" in line
    assert manifest_bytes(tmp_path / "again") == again


def test_a_training_run_is_no_dataset_folder(inputs, tmp_path, capsys):
    """A run directory given as --output took train/, validation/ and manifest.json beside its
    checkpoints without a word; --overwrite would have cleared the folder first."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    for flags in ((), ("--overwrite",)):
        assert prepare(inputs, run, *flags) == 2
        assert (f"--output {run} holds a training run (checkpoints, metrics.jsonl): give the "
                "dataset a folder of its own") in one_error_line(capsys)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_a_vocabulary_folder_is_not_written_over_by_another_vocabulary(inputs, tmp_path,
                                                                       capsys):
    """`prepare --output work/vocab` (a `bertforge vocab` output, no dataset) wrote --vocab over
    its vocab.txt without a word, and with it the ids the user's datasets read by. The same
    vocabulary there is no conflict; --overwrite replaces it."""
    folder = tmp_path / "vocab"
    folder.mkdir()
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nmine\n", "utf-8")
    mine = (folder / "vocab.txt").read_bytes()
    assert prepare(inputs, folder) == 2
    assert (f"{folder}/vocab.txt holds another vocabulary than --vocab {inputs / 'vocab.txt'}, "
            f"and {folder} holds no dataset") in one_error_line(capsys)
    assert sorted(p.name for p in folder.iterdir()) == ["vocab.txt"]
    assert (folder / "vocab.txt").read_bytes() == mine
    same = tmp_path / "same"
    same.mkdir()
    (same / "vocab.txt").write_bytes((inputs / "vocab.txt").read_bytes())
    assert prepare(inputs, same) == 0
    assert prepare(inputs, folder, "--overwrite") == 0
    assert (folder / "vocab.txt").read_bytes() == (inputs / "vocab.txt").read_bytes()


def test_a_dataset_inside_its_corpus_folder_is_never_read_as_corpus(inputs, tmp_path, capsys):
    """`--input corpus --output corpus/shards`: the second run read the first one's shards,
    manifest and log as text, so the same job again was refused as another dataset, and
    `--overwrite` then crashed, leaving shards without a manifest. And `--overwrite` with
    another --num-shards left the replaced dataset's shards beside the new ones."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "corpus.jsonl").write_bytes((inputs / "corpus.jsonl").read_bytes())
    output = corpus / "shards"

    def prepare_folder(output, *flags) -> int:
        return main(["prepare", f"--input={corpus}", f"--output={output}",
                     f"--vocab={inputs / 'vocab.txt'}", "--max-seq-length=48",
                     "--num-shards=2", *flags])

    assert prepare_folder(output) == 0
    first = manifest_bytes(output)
    assert list(json.loads(first)["input_files"]) == [str(corpus / "corpus.jsonl")]
    assert prepare_folder(output) == 0  # the same job: allowed, the same dataset
    assert manifest_bytes(output) == first

    assert prepare_folder(output, "--num-shards=3", "--overwrite") == 0
    assert sorted(path.name for path in (output / "train").iterdir()) == [
        f"part-0000{i}-of-00003.arrow" for i in range(3)]
    capsys.readouterr()

    # The same job spelled from another working directory is the same job (it was refused:
    # "no longer: corpus/corpus.jsonl; new: /abs/corpus/corpus.jsonl").
    def shards() -> dict:
        return json.loads(manifest_bytes(output))["splits"]  # every shard's sha256

    before = shards()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["prepare", "--input=corpus", "--output=corpus/shards",
                     f"--vocab={inputs / 'vocab.txt'}", "--max-seq-length=48",
                     "--num-shards=3"]) == 0
    assert shards() == before  # the same bytes: the spelling changes no doc_id
    assert "already holds this dataset" in capsys.readouterr().err  # nothing to do

    assert prepare_folder(corpus) == 2  # the corpus folder as the output: nothing else to read
    assert "matches no file outside --output" in one_error_line(capsys)
    assert (corpus / "corpus.jsonl").exists()


def test_no_dataset_is_replaced_under_a_reader_or_by_a_second_writer(inputs, tmp_path, capsys):
    output = tmp_path / "shards"
    assert prepare(inputs, output) == 0
    digest = hashlib.sha256(manifest_bytes(output)).hexdigest()
    capsys.readouterr()

    with reading_dataset(str(output), "train"):
        assert prepare(inputs, output, "--overwrite") == 2
        assert f"{output} is being read by a bertforge train" in one_error_line(capsys)
    assert not (output / ".readers").exists()  # the reader's record is gone with it

    with exclusive_directory(str(output), "prepare"):
        assert prepare(inputs, output) == 2
        assert "another bertforge prepare is running in" in one_error_line(capsys)
    assert hashlib.sha256(manifest_bytes(output)).hexdigest() == digest

    # An output that is a file (the vocab's, say): said so, not "cannot write the run lock".
    assert prepare(inputs, inputs / "vocab.txt") == 2
    assert f"--output {inputs / 'vocab.txt'} is a file" in one_error_line(capsys)


@pytest.mark.parametrize("mode", [(), ("--direct_num_workers=2",
                                     "--direct_running_mode=multi_processing")])
def test_a_corpus_with_no_usable_document_is_one_line_and_leaves_no_directory(
        inputs, tmp_path, mode):
    """In one process and with worker processes (the demo's mode), whose harness printed the
    failed bundle's ~60-line traceback straight to the console, and the one-process job five
    `wrote ... 0 rows` lines for shards it then removed: the start line, what was read, the
    error and where the engines' output went. Run as a user runs it, in a process of its own
    (in pytest's process its logging handlers, not the console, would get the lines)."""
    import subprocess
    import sys

    output = tmp_path / "new" / "shards"
    done = subprocess.run(
        [sys.executable, "-m", "bertforge.cluster.cli", "prepare",
         f"--input={inputs / 'empty.jsonl'}", f"--output={output}",
         f"--vocab={inputs / 'vocab.txt'}", "--max-seq-length=48", "--num-shards=2", *mode],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    console = (done.stdout + done.stderr).splitlines()
    # Nothing about a file the failed job then removes (shards, rejects.jsonl).
    assert not any("Traceback" in line or ".arrow" in line or "rejects.jsonl" in line
                   for line in console), console
    assert [line for line in console if "error" in line] == [
        line for line in console
        if line.startswith("bertforge prepare: error: no usable document remains")]
    assert len(console) <= 6, console
    assert not output.exists()


@pytest.mark.parametrize("command", ["prepare", "pipeline"])
def test_sigterm_stops_a_local_prepare_at_once_and_keeps_its_work_to_continue(inputs, tmp_path,
                                                                              command):
    """Beam's runner joins its worker processes, which would finish their bundle first; a stop
    ends them, then exits 143 with one line saying that the same command continues. (A
    pipeline's prepare stage hung at 0 % CPU: nothing stopped the workers there.)"""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    import psutil

    rng = random.Random(5)
    words = [f"word{i}" for i in range(120)]
    with open(tmp_path / "big.jsonl", "w", encoding="utf-8") as f:  # ~20 MB: minutes of work
        for doc in range(20_000):
            text = " ".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(8))
            f.write(json.dumps({"doc_id": f"d{doc}", "text": text}) + "\n")
    output = tmp_path / "shards"
    arguments = [f"--input={tmp_path / 'big.jsonl'}", f"--output={output}",
                 f"--vocab={inputs / 'vocab.txt'}", "--direct_num_workers=2",
                 "--direct_running_mode=multi_processing"]
    if command == "pipeline":
        output = tmp_path / "work" / "shards-128"
        (tmp_path / "pipe.toml").write_text(
            f'workdir = "work"\n[vocab]\npath = "{inputs / "vocab.txt"}"\n[prepare]\n'
            f'inputs = ["big.jsonl"]\nbeam_args = ["--direct_num_workers=2", '
            f'"--direct_running_mode=multi_processing"]\n[phase1]\n'
            f'recipe = "bert_tiny_phase1"\nmax_seq_length = 128\n[cluster]\nworkers = 1\n')
        arguments = [str(tmp_path / "pipe.toml")]
    process = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "bertforge"), command, *arguments],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def command_line(child) -> str:
        with contextlib.suppress(psutil.Error):  # gone, or a zombie not yet reaped
            return " ".join(child.cmdline())
        return ""

    workers = []
    while not workers:  # the job is under way once its SDK workers run
        assert process.poll() is None, process.communicate()
        workers = [p for p in psutil.Process(process.pid).children(recursive=True)
                   if QUIET_HARNESS_MODULE in command_line(p)]
        time.sleep(0.2)
    time.sleep(2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    (line,) = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert line.startswith(f"bertforge {command}: stopped by SIGTERM; the same command "
                           "continues it")
    assert "Traceback" not in err
    # The work so far stays for the same command to continue (tests/pipelines/
    # test_prepare_any_size.py continues one); no dataset is there yet.
    assert (output / ".prepare-work" / "job.json").exists()
    assert not (output / "manifest.json").exists()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_a_complete_dataset_drops_what_a_kill_after_its_manifest_left(inputs, tmp_path, capsys,
                                                                      monkeypatch):
    """A kill after the manifest, before the job removed its work record and pieces: the next
    prepare continued that record, reused every bundle (the manifest's step among them) after
    removing the manifest, and failed, "manifest.json not found": the dataset was lost. The
    pipeline's rerun skipped the stage as complete and kept the record (GBs at scale) for
    good."""
    from bertforge.cluster.commands.guarded_prepare import dataset_complete
    from bertforge.cluster.commands.stages import shards_complete
    from bertforge.pipelines import local_job
    from bertforge.pipelines.local.work_dir import WorkDir
    from bertforge.pipelines.prepare_options import PrepareConfig

    output = tmp_path / "shards"
    with monkeypatch.context() as killed:  # what the kill skips: the job's own clean-up
        killed.setattr(WorkDir, "discard", lambda self: None)
        killed.setattr(local_job, "after_success", lambda runner, output: None)
        assert prepare(inputs, output) == 0
    assert (output / ".prepare-work" / "job.json").exists()
    piece = output / "train" / "part-00000-of-00002.arrow.piece3-ab12.tmp"
    piece.write_bytes(b"a piece of a redone bundle")
    first = manifest_bytes(output)
    capsys.readouterr()
    assert prepare(inputs, output) == 0
    assert f"[prepare] {output} already holds this dataset" in capsys.readouterr().err
    assert manifest_bytes(output) == first
    assert not (output / ".prepare-work").exists() and not piece.exists()

    (output / ".prepare-work" / "stage-1").mkdir(parents=True)
    config = PrepareConfig(inputs=(str(inputs / "corpus.jsonl"),), output=str(output),
                           vocab=str(inputs / "vocab.txt"), max_seq_length=48, num_shards=2)
    assert shards_complete(config, str(tmp_path))
    assert not (output / ".prepare-work").exists() and (output / "manifest.json").exists()
    # A shard lost since: not complete (the stage makes it again), as prepare judges it; the
    # pipeline counted it done.
    os.remove(output / "train" / "part-00000-of-00002.arrow")
    assert not shards_complete(config, str(tmp_path))
    assert not dataset_complete(str(output))


def test_once_the_workers_are_stopped_only_beams_own_threads_fail_quietly(monkeypatch):
    """On SIGTERM the Beam workers are terminated, and Beam's threads that talk to them fail:
    the one that watched a worker, and (seen under a loaded suite) its control channel's
    reader. Those say nothing; any other thread's failure still prints its traceback."""
    import os
    import threading

    from bertforge.cluster.commands.guarded_prepare import stop_beam_workers

    reported = []  # what the hook before the filter (Python's: a traceback) was handed
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.thread.name))
    stop_beam_workers()  # none running here: it only installs the filter
    beams = {}
    beam_file = os.path.join(os.sep, "site-packages", "apache_beam", "runners", "handlers.py")
    exec(compile("def _control_read():\n    raise RuntimeError('channel closed')\n", beam_file,
                 "exec"), beams)

    def ours():
        raise RuntimeError("a bug of ours")

    for target, name in ((beams["_control_read"], "Thread-9 (_control_read)"),
                         (ours, "run_worker"), (ours, "Thread-10 (ours)")):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    assert reported == ["Thread-10 (ours)"]


def test_the_summary_writes_a_path_as_the_user_named_it(inputs, tmp_path, capsys):
    """A non-ASCII output came back as JSON escapes (`r\\u00e9sum\\u00e9`) under console lines
    that showed it as typed."""
    output = tmp_path / "données 中"
    assert prepare(inputs, output, "--quiet") == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["output"] == str(output)
    assert f'"output": "{output}"' in printed, printed


def test_a_dataset_finished_just_before_the_lock_is_not_cleaned_as_this_runs_own(
        tmp_path, monkeypatch):
    """Another prepare ends (its manifest written, its lock let go) between this one's first
    look at the folder and its lock: this one's failure, or its refusal of that dataset, took
    the folder for one it had made from nothing and deleted the finished dataset."""
    from bertforge.cluster.safety import dataset_guard

    output = tmp_path / "shards"

    @contextlib.contextmanager
    def another_ends_first(root, command, **timing):
        os.makedirs(os.path.join(root, "train"))
        (output / "train" / "part-00000-of-00001.arrow").write_bytes(b"shard")
        (output / "manifest.json").write_text("{}", encoding="utf-8")
        with exclusive_directory(root, command, **timing) as lock:
            yield lock

    monkeypatch.setattr(dataset_guard, "exclusive_directory", another_ends_first)
    config = type("Config", (), {"vocab": str(tmp_path / "vocab.txt"), "inputs": ()})()
    with pytest.raises(RuntimeError), \
            dataset_guard.writing_dataset(str(output), config, overwrite=False):
        raise RuntimeError("this prepare fails")
    assert sorted(os.listdir(output)) == ["manifest.json", "train"]


def test_a_run_is_refused_a_dataset_that_a_prepare_is_writing(tmp_path):
    """A prepare looks for readers once, when it starts: a train or eval that began to read
    the dataset after that (a --overwrite, or the same job making a lost shard again) had its
    shards rewritten or deleted under it. Now the reader is refused, naming the prepare."""
    from bertforge.cluster.safety.dataset_guard import DatasetConflict

    output = tmp_path / "shards"
    with exclusive_directory(str(output), "prepare"):  # a prepare past its look for readers
        with pytest.raises(DatasetConflict,
                           match=rf"^{output} is being written by a bertforge prepare \(host "
                                 r".*\): wait for it to end"), \
                reading_dataset(str(output), "train"):
            pass
        assert not (output / ".readers").exists()  # the refused reader's record went
    with reading_dataset(str(output), "train"):  # once it ended
        pass


def test_inspect_verify_reads_as_a_reader_that_prepare_respects(tmp_path, monkeypatch, capsys):
    """`inspect --verify` hashes every shard (minutes on a large dataset) but registered as no
    reader: a `prepare --overwrite` meanwhile rewrote the shards under it, and it reported
    sha256 and row-count damage that was not there. Now it is a reader like train and eval,
    and is refused, naming the prepare, while one writes the dataset."""
    from bertforge.cluster.safety import dataset_guard
    from bertforge.pipelines import verify_dataset
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "data"), {"train": [20, 20]}, max_seq_length=32)
    verify = verify_dataset.verify_dataset
    seen = []

    def verify_seeing_readers(data_dir):
        seen.extend(holder.command for holder in dataset_guard.live_readers(data_dir))
        with pytest.raises(dataset_guard.DatasetConflict, match="is being read by a bertforge "
                           "inspect"):
            dataset_guard.refuse_readers(data_dir)  # what a prepare now does
        return verify(data_dir)

    monkeypatch.setattr(verify_dataset, "verify_dataset", verify_seeing_readers)
    assert main(["inspect", data, "--verify", "--samples", "0"]) == 0
    assert seen == ["inspect"]
    assert not os.path.exists(os.path.join(data, dataset_guard.READERS_DIR))
    capsys.readouterr()

    with exclusive_directory(data, "prepare"):  # a prepare writing it now
        assert main(["inspect", data, "--verify"]) == 2
    assert f"{data} is being written by a bertforge prepare" in one_error_line(capsys)


@pytest.mark.parametrize("when", ["folder made", "lock file written"])
def test_a_reader_whose_record_a_prepare_swept_away_is_refused_too(tmp_path, monkeypatch, when):
    """prepare looks for readers while a reader's record is being made, before its lock file is
    in it: it took the record for a dead reader's and removed it; the reader then failed naming
    its record's folder ("cannot write the run lock in DATA/.readers/..."), or, its lock file
    gone before the link, read on unrecorded, as if the dataset were read-only, while the
    prepare rewrote it."""
    from bertforge.cluster.safety import dataset_guard, run_lock

    output = tmp_path / "shards"
    write_private, link = run_lock._LocalFile._write_private, os.link

    def swept_then_write(self, text):
        dataset_guard.live_readers(str(output))  # the prepare's look, at this moment
        return write_private(self, text)

    def swept_then_link(source, target):
        if dataset_guard.READERS_DIR in str(target):
            dataset_guard.live_readers(str(output))
        return link(source, target)

    with exclusive_directory(str(output), "prepare"):
        if when == "folder made":
            monkeypatch.setattr(run_lock._LocalFile, "_write_private", swept_then_write)
        else:
            monkeypatch.setattr(run_lock.os, "link", swept_then_link)
        with pytest.raises(dataset_guard.DatasetConflict, match="is being written by a "
                           "bertforge prepare"), reading_dataset(str(output), "train"):
            pass


def test_a_record_without_a_lock_goes_once_old(tmp_path):
    """A reader killed before its lock file was written left an empty record: it goes once
    older than a lock's staleness; a young one is a reader's being made."""
    from bertforge.cluster.safety.dataset_guard import READERS_DIR, live_readers

    old, young = tmp_path / READERS_DIR / "old", tmp_path / READERS_DIR / "young"
    old.mkdir(parents=True)
    young.mkdir()
    os.utime(old, (0, 0))
    assert live_readers(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path / READERS_DIR)) == ["young"]


def test_a_pipelines_prepare_stage_leaves_a_live_prepare_and_its_readers_alone(
        tmp_path, monkeypatch):
    """The pipeline's prepare stage cleared its dataset's folder (`rmtree`) with no look at
    who used it: a `bertforge prepare` run by hand into it lost its work and its lock, a train
    reading it its shards and its reader record. Now the stage takes the dataset's lock and
    refuses a reader, as `bertforge prepare` does; run alone, it clears and makes it."""
    import bertforge.pipelines.prepare as prepare_module
    from bertforge.cluster.commands import stages
    from bertforge.cluster.safety.dataset_guard import DatasetConflict

    made = []
    monkeypatch.setattr(prepare_module, "run",
                        lambda config, beam_args, start_over=False: made.append(1) or {})
    output = tmp_path / "work" / "shards-64"
    config = type("Config", (), {"output": str(output)})()
    (output / "train").mkdir(parents=True)
    piece = output / "train" / "part-00000-of-00002.arrow.piece0-x.tmp"
    piece.write_text("a live prepare's piece")
    with exclusive_directory(str(output), "prepare"), \
            pytest.raises(ValueError, match="another bertforge prepare is running in"):
        stages.prepare_dataset(config, [])
    assert piece.exists() and not made
    with reading_dataset(str(output), "eval"), \
            pytest.raises(DatasetConflict, match="is being read by a bertforge eval"):
        stages.prepare_dataset(config, [])
    assert piece.exists() and not made
    # A finished dataset's check drops a work record a late stop left, but not a live one's.
    (output / "manifest.json").write_text("{}")
    (output / ".prepare-work").mkdir()
    with exclusive_directory(str(output), "prepare"), \
            pytest.raises(ValueError, match="another bertforge prepare is running in"):
        stages.shards_complete(config, str(tmp_path / "work"))
    assert (output / ".prepare-work").exists()
    (output / ".prepare-work").rmdir()
    stages.prepare_dataset(config, [])  # alone: what was there goes, the job runs
    assert made == [1] and os.listdir(output) == []


def test_a_reader_starting_as_the_last_reader_ends_is_recorded(tmp_path, monkeypatch):
    """A train or eval began to read a dataset just as the last run reading it ended: that one
    removed the empty DATA/.readers after the new one saw it there and before its record was
    made in it, and the new run failed at once: "cannot write the run lock in
    DATA/.readers/...: No such file or directory" (seen with real processes)."""
    from bertforge.cluster.safety.dataset_guard import READERS_DIR, live_readers

    output = tmp_path / "shards"
    output.mkdir()
    last_reader = reading_dataset(str(output), "eval")
    last_reader.__enter__()
    mkdir = os.mkdir

    def the_last_reader_ends_first(path, mode=0o777):
        if os.path.basename(os.path.dirname(path)) == READERS_DIR and \
                not the_last_reader_ends_first.ended:
            last_reader.__exit__(None, None, None)
            the_last_reader_ends_first.ended = True
        return mkdir(path, mode)

    the_last_reader_ends_first.ended = False
    monkeypatch.setattr(os, "mkdir", the_last_reader_ends_first)
    with reading_dataset(str(output), "train"):
        assert the_last_reader_ends_first.ended
        assert [holder.command for holder in live_readers(str(output))] == ["train"]
    assert sorted(os.listdir(output)) == []


def test_a_dataset_this_user_may_only_read_is_read_unrecorded(tmp_path, monkeypatch):
    """A dataset folder of another user (shared, mode 755): no reader's record can be made in
    it, and none is needed, as no prepare of this user can replace it. The run failed at
    once: "cannot write the run lock in DATA/.readers/...: Permission denied" (seen as an
    unprivileged user; the test runs as any user, so the refusal is the OS's, stood in)."""
    from bertforge.cluster.safety.dataset_guard import READERS_DIR

    output = tmp_path / "shards"
    output.mkdir()
    makedirs = os.makedirs

    def not_ours_to_write(path, *args, **kwargs):
        if READERS_DIR in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", not_ours_to_write)
    read = []
    with reading_dataset(str(output), "train"):
        read.append(1)
    assert read == [1]
    assert sorted(os.listdir(output)) == []
