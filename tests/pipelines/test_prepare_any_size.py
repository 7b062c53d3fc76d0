"""`prepare` on the local runner with its data on disk (issue 23): the bounded path forced on a
small corpus gives the recorded shards, a `kill -9` then the same command gives them too (with a
progress line every interval), and a rerun of another job into the work of this one is refused
until it starts over.

The corpus and the expected shard digests are those of `tests/test_numbers_unchanged.py`.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from bertforge.pipelines.local import runner as local_runner
from bertforge.pipelines.local import spill
from bertforge.pipelines.local.work_dir import WORK_DIR_NAME, WorkConflict, WorkDir
from tests.test_numbers_unchanged import EXPECTED_SHARDS, _golden_corpus, _sha256
from tests.training.conftest import google_layout_vocab

# The recorded job's settings, as flags.
JOB_FLAGS = ["--max-seq-length", "48", "--dupe-factor", "2", "--num-shards", "2", "--seed", "99",
             "--validation-fraction", "0.2"]
# A stage whose input is not sized yet says how long it has run; the counters come once a
# document is read (never "0% of 0.0 MB", never "0 documents (0 MB) read").
PROGRESS_LINE = re.compile(
    r"\[prepare\] [^(;]+ \(stage \d+ of \d+\), "
    r"(\d+% of ([\d.]*[1-9][\d.]* MB|[\d,]+ (kB|bytes)) in [^;]+|\d+ (s|min \d+ s) in this stage)"
    r"(; [1-9][\d,]* documents \(([\d,]*[1-9][\d,]* MB|[\d,]+ (kB|bytes))\) read, [\d,]+ kept, "
    r"[\d,]+ instances)?"
    r"; \d+ (s|min \d+ s) in$")
TINY_BUNDLES = ["--local_bundle_mb", "0.002"]  # 2 KB: ~100 bundles in the tokenizing stage


@pytest.fixture()
def golden(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _golden_corpus(str(corpus))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(google_layout_vocab()) + "\n", encoding="utf-8")
    return ["--input", str(corpus), "--vocab", str(vocab), *JOB_FLAGS]


def _shards(output) -> dict[str, str]:
    return {os.path.relpath(path, output): _sha256(path)
            for path in glob.glob(os.path.join(output, "*", "*.arrow"))}


def _leftovers(output) -> list[str]:
    """What a finished run must not leave: its work directory, temporary pieces or shards."""
    return sorted(os.path.relpath(p, output) for p in glob.glob(os.path.join(output, "**", "*"),
                  recursive=True) if WORK_DIR_NAME in p or p.endswith(".tmp") or ".tmp-" in p) \
        + ([WORK_DIR_NAME] if os.path.exists(os.path.join(output, WORK_DIR_NAME)) else [])


@pytest.mark.parametrize("workers", [1, 2])
def test_spilled_runs_and_merges_in_passes_give_the_recorded_shards(golden, tmp_path, caplog,
                                                                     monkeypatch, workers):
    """Bundles of 2 KB, a sort buffer of 1 KB (a run per worker message), merges of 2 runs at a
    time: every grouping goes through many runs and merge passes, in the runner's process."""
    from bertforge.pipelines.prepare import main

    monkeypatch.setattr(local_runner, "SORT_BUFFER_BYTES", 1024)
    monkeypatch.setattr(spill, "MERGE_FAN_IN", 2)
    made = []
    original = spill.GroupSpill.groups

    def counting_groups(self):
        made.append(len(self.runs))
        return original(self)

    monkeypatch.setattr(spill.GroupSpill, "groups", counting_groups)
    output = tmp_path / "shards"
    mode = ["--direct_num_workers", "2", "--direct_running_mode", "multi_threading"] \
        if workers == 2 else []
    main(golden + ["--output", str(output), *TINY_BUNDLES, "--quiet", "--progress_seconds",
                   "0.05", *mode])
    assert _shards(output) == EXPECTED_SHARDS
    assert max(made) > 8, "the groupings should have been read from many runs"
    chatter = [r.getMessage() for r in caplog.records
               if r.name.startswith("bertforge") and r.levelno < logging.WARNING]
    assert chatter == [], "--quiet: no progress line, no other line but the summary"
    assert _leftovers(output) == []


def _prepare(args: list[str], **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "bertforge.cluster.cli", "prepare", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)


def _bundles_done(output) -> int:
    return len(glob.glob(os.path.join(output, WORK_DIR_NAME, "*", "b*.json")))


def _kill_9_after(args: list[str], output, num_bundles: int, temporary) -> None:
    """Start the command, kill -9 it and its workers (as the OOM killer might) once that many
    bundles are done; `temporary` is its TMPDIR."""
    run = _prepare(args, env={**os.environ, "TMPDIR": str(temporary)})
    deadline = time.monotonic() + 240
    while _bundles_done(output) < num_bundles and run.poll() is None and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def test_kill_9_then_the_same_command_continues_and_gives_the_same_shards(golden, tmp_path):
    output = tmp_path / "shards"
    args = golden + ["--output", str(output), *TINY_BUNDLES]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    _kill_9_after(args, output, num_bundles=60, temporary=temporary)
    done_before = _bundles_done(output)
    assert done_before >= 60
    assert not os.path.exists(output / "manifest.json")
    # Its work is in the output, to continue; Beam's `beam-pipeline-temp*`, which only a run
    # that ends removes, was left in TMPDIR by every killed run.
    assert os.listdir(temporary) == []

    # Another job into this work is refused, naming what differs, and leaves the work alone.
    other = [a if a != "99" else "100" for a in args]  # another --seed
    refused = _prepare(other)
    log, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2, log
    assert "holds an unfinished run of another job (differs in: seed 99 -> 100)" in log, log
    assert "add --overwrite to start over" in log
    assert _bundles_done(output) == done_before

    second = _prepare(args + ["--progress_seconds", "0.5"])
    log, _ = second.communicate(timeout=300)
    assert second.returncode == 0, log
    assert "continued an earlier run" in log, log
    progress = [line for line in log.splitlines() if PROGRESS_LINE.search(line)]
    assert len(progress) >= 3, log  # a line every interval, in the same words every time
    assert not [line for line in log.splitlines() if " (stage " in line and line not in progress]
    reused = int(log.split("continued an earlier run: ")[1].split(" bundles")[0])
    assert reused >= done_before  # every bundle done before the kill, not redone
    assert _shards(output) == EXPECTED_SHARDS
    assert _leftovers(output) == []


def test_start_over_discards_the_work_of_another_job(tmp_path):
    work = WorkDir(str(tmp_path / WORK_DIR_NAME), {"seed": 99})
    work.open()
    work.stage("TokenizeParts", ["a", "b"]).commit_bundle(0, {"outputs": {}})
    other = WorkDir(work.root, {"seed": 100})
    with pytest.raises(WorkConflict, match="differs in: seed 99 -> 100"):
        other.open()
    assert other.open(start_over=True) is False  # nothing to continue
    assert os.listdir(work.root) == ["job.json"]
    assert WorkDir(work.root, {"seed": 100}).open() is True  # its own work, to continue


def test_a_refused_rerun_names_the_input_files_that_changed_not_every_file(tmp_path):
    """One file of a corpus of thousands touched since the killed run: the refusal named every
    file, twice, in one line, and which one had changed was left to find."""
    files = [[f"/corpus/part-{i:05d}.txt", 1000 + i, 1.0e9] for i in range(2000)]
    work = WorkDir(str(tmp_path / WORK_DIR_NAME), {"inputs": files, "seed": 99})
    work.open()
    touched = [list(f) for f in files]
    touched[7][2] = 1.5e9
    with pytest.raises(WorkConflict) as refused:
        WorkDir(work.root, {"inputs": touched + [["/corpus/new.txt", 5, 2.0e9]],
                            "seed": 99}).open()
    message = str(refused.value)
    assert message.endswith("(differs in: inputs /corpus/new.txt absent -> [5, 2000000000.0], "
                            "/corpus/part-00007.txt [1007, 1000000000.0] -> "
                            "[1007, 1500000000.0])"), message
    assert len(message) < 400
