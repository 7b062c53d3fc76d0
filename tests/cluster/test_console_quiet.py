"""The console of real `bertforge train`, `eval` and `export` runs holds the project's own lines
only; the engines' output is in the run's logs, and on the console with --verbose
(cluster.worker_output). One tiny training run (1 worker, real Ray and DeepSpeed) serves them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow

BERTFORGE = os.path.join(os.path.dirname(sys.executable), "bertforge")
# What the project prints (see cluster/, training/): stage, progress and step lines are
# "[command] ...", notices and errors "bertforge ...: ...". A command's result (train's and
# eval's JSON, export's directory) is checked apart, as the output's end.
PROJECT_LINE = re.compile(r"^(\[(train|eval|export|finetune|glue|demo|prepare|pipeline)\] |"
                          r"bertforge( \w+)?: )")
# DeepSpeed's logger, on importing it: the engine output every command here causes.
DEEPSPEED_NOTICE = "accelerator to"  # "Setting accelerator to CPU" here


def foreign_lines(console: str, result: list[str]) -> list[str]:
    """The console's lines that are neither the project's nor the command's `result` lines."""
    lines = console.splitlines()
    body = lines[:len(lines) - len(result)] if result else lines
    assert lines[len(body):] == result, console  # the result ends the output
    return [line for line in body if line.strip() and not PROJECT_LINE.match(line)]


def run(*args: str, tmpdir: str) -> subprocess.CompletedProcess:
    """A `bertforge` command with its own TMPDIR (so its local Ray's sessions are its own)."""
    return subprocess.run([BERTFORGE, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": tmpdir})


def json_lines(stdout: str) -> list[str]:
    """The JSON document that ends `stdout`, as printed."""
    lines = stdout.splitlines()
    start = len(lines) - 1 - lines[::-1].index("{")
    json.loads("\n".join(lines[start:]))
    return lines[start:]


@pytest.fixture(scope="module")
def tmpdir():
    # Short: Ray's unix socket paths live under it and are limited to 107 characters.
    path = tempfile.mkdtemp(prefix="bfq", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def trained(tmpdir):
    data, run_dir = os.path.join(tmpdir, "data"), os.path.join(tmpdir, "run")
    write_dataset(data)
    result = run("train", "--data", data, "--run-dir", run_dir, "--preset", "tiny",
                 "--precision", "fp32", "--max-steps", "3", "--micro-batch-size", "2",
                 "--workers", "1", "--max-failures", "0", "--log-every", "1", tmpdir=tmpdir)
    assert result.returncode == 0, result.stdout + result.stderr
    return data, run_dir, result


def test_train_prints_only_its_own_lines_and_logs_the_rest(trained):
    _, run_dir, result = trained
    console = result.stdout + result.stderr
    assert result.stderr == ""
    assert foreign_lines(result.stdout, json_lines(result.stdout)) == []
    assert "[train] step 3/3 |" in console and "(RayTrainWorker" not in console
    logs = os.path.join(run_dir, "logs")
    driver_log = open(os.path.join(logs, "train.log"), encoding="utf-8").read()
    assert "(RayTrainWorker pid=" in driver_log  # Ray's own forwarding, kept in the file
    worker_log = open(os.path.join(logs, "worker-0.log"), encoding="utf-8").read()
    assert "[train] step 3/3" in worker_log


def test_eval_shows_progress_is_limited_by_max_batches_and_prints_only_its_own(trained,
                                                                             tmpdir):
    data, run_dir, _ = trained
    result = run("eval", run_dir, "--data", data, "--batch-size", "2", "--max-batches", "3",
                 tmpdir=tmpdir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    assert foreign_lines(result.stdout, json_lines(result.stdout)) == []
    assert "[eval] " in result.stdout and ": 3 batches of 2 (validation)" in result.stdout
    assert json.loads("\n".join(json_lines(result.stdout)))["num_sequences"] == 6
    # DeepSpeed's logger (imported to read the checkpoint) went to the run's log instead.
    log = open(os.path.join(run_dir, "logs", "eval.log"), encoding="utf-8").read()
    assert DEEPSPEED_NOTICE in log


def test_export_is_quiet_and_verbose_shows_the_engines_output(trained, tmpdir):
    _, run_dir, _ = trained
    quiet = run("export", run_dir, "--output", os.path.join(tmpdir, "hf"), tmpdir=tmpdir)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert quiet.stderr == ""
    assert foreign_lines(quiet.stdout, [os.path.join(tmpdir, "hf")]) == []
    # It names the run and step whose weights it exported.
    assert re.search(r"^\[export\] run \d{8}T\d{6}\.\d{3}Z, step \d+, from ", quiet.stdout,
                     re.MULTILINE), quiet.stdout
    # The same command with --verbose: the chatter this test would catch is on the console.
    verbose = run("export", run_dir, "--output", os.path.join(tmpdir, "hf2"), "--verbose",
                  tmpdir=tmpdir)
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    chatter = foreign_lines(verbose.stdout, [os.path.join(tmpdir, "hf2")]) + \
        foreign_lines(verbose.stderr, [])
    assert any(DEEPSPEED_NOTICE in line for line in chatter), chatter
    log = open(os.path.join(run_dir, "logs", "export.log"), encoding="utf-8").read()
    assert log.count(DEEPSPEED_NOTICE) == 2  # both runs' (appended)
