"""How a command ends when its work fails, found by trying to break it: a crash shows its
traceback whatever the command imported, a full disk is one line for every command (not a
traceback, not a retry into the same wall), a stop between fine-tuning runs is not lost."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.commands import finetune_sweep
from bertforge.pipelines.vocab import train_wordpiece_vocab
from bertforge.pipelines.vocab_options import VocabConfig
from bertforge.training import export
from bertforge.training.errors import UserInputError

REPO = __file__.rsplit("/tests/", 1)[0]
CRASH_AFTER_RAY = """
import sys
import ray  # replaces sys.excepthook; the quiet console took its lines for Ray's
from bertforge.cluster import cli

def handler(args):
    raise RuntimeError("deep inside a fine-tune")

build = cli.build_parser
def patched():
    parser = build()
    parser._subparsers._group_actions[0].choices["export"].set_defaults(handler=handler)
    return parser
cli.build_parser = patched
sys.exit(cli.main(["export", "x", "--output", "y"]))
"""


def test_a_crash_after_ray_was_imported_shows_its_traceback(tmp_path):
    """`finetune` and `glue` import Ray: a crash of theirs ended with exit code 1 and not a
    word on the console."""
    done = subprocess.run([sys.executable, "-c", CRASH_AFTER_RAY], capture_output=True,
                          text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):"), done.stderr
    assert done.stderr.rstrip().endswith("RuntimeError: deep inside a fine-tune")


def test_a_file_where_a_directory_was_wanted_is_one_line(tmp_path, capsys):
    data = tmp_path / "shards"
    data.mkdir()
    assert main(["finetune", "--task", "sst2", "--model", str(tmp_path), "--train",
                 str(data), "--dev", str(data), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bertforge finetune: error: ") and "\n" not in err, err


def test_a_full_disk_is_one_line_for_any_command(tmp_path, monkeypatch, capsys):
    """An engine that drops the errno (safetensors), and prepare's own message."""
    def full(*args, **kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")

    monkeypatch.setattr(export, "export_checkpoint", full)
    monkeypatch.setattr("bertforge.training.inputs.check_export_inputs", lambda *a: None)
    assert main(["export", str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        "bertforge export: error: no space left on the disk (Error while serializing: I/O "
        "error: No space left on device (os error 28)): make room, or write elsewhere, and "
        "run the same command again\n")

    def prepare_full(command, overwrite):
        raise OSError(errno.ENOSPC, f"no space left on the disk of {tmp_path} (the dataset "
                      "and its work directory .prepare-work): free space or choose another "
                      "--output; nothing of this run was kept")

    monkeypatch.setattr("bertforge.cluster.commands.guarded_prepare.prepare_guarded",
                        prepare_full)
    assert main(["prepare", "--input", str(tmp_path / "x.jsonl"), "--output",
                 str(tmp_path / "shards"), "--vocab", str(tmp_path / "vocab.txt")]) == 2
    assert capsys.readouterr().err == (
        f"bertforge prepare: error: no space left on the disk of {tmp_path} (the dataset and "
        "its work directory .prepare-work): free space or choose another --output; nothing "
        "of this run was kept\n")


def test_an_error_that_is_its_own_cause_ends_the_command(tmp_path, monkeypatch, capsys):
    """Ray's failed start (its dashboard, on a full TMPDIR) raises `e from e`: the command's
    look for a full disk down the chain spun for ever, with not a word on the console (seen
    by hand: `bertforge train` with TMPDIR on a full tmpfs, ended only by a SIGTERM)."""
    def ray_like(*args, **kwargs):
        try:
            raise Exception("\nthe dashboard's last lines")
        except Exception as e:
            raise e from e

    def too_long(signum, frame):
        raise TimeoutError("the command's error handler did not return")

    monkeypatch.setattr(export, "export_checkpoint", ray_like)
    monkeypatch.setattr("bertforge.training.inputs.check_export_inputs", lambda *a: None)
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        assert main(["export", str(tmp_path), "--output", str(tmp_path / "hf")]) == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert "the dashboard's last lines" in capsys.readouterr().err


def test_a_full_disk_in_a_fine_tune_is_not_retried(tmp_path, monkeypatch):
    """Each of the local worker's four attempts fine-tuned from the start into the same wall,
    then the command ended with exit code 1 and nothing said."""
    def full(cfg):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("bertforge.training.finetune.loop.finetune", full)
    monkeypatch.setattr(finetune_sweep.FinetuneConfig, "from_dict", staticmethod(dict))
    output = str(tmp_path / "runs" / "lr1e-05-seed1")
    with pytest.raises(UserInputError, match=rf"^no space left on the disk of {output} \("
                       r"\[Errno 28\] No space left on device\): make room"):
        finetune_sweep.fine_tune_one({"output": output})


def run_local_worker(function: str, tmp_path) -> subprocess.CompletedProcess:
    """The local worker's own process running tests.support.local_workers' `function`."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "function": f"tests.support.local_workers:{function}",
        "config": {"dir": str(tmp_path)}, "error_file": str(tmp_path / "error")}))
    return subprocess.run([sys.executable, "-m", "bertforge.cluster.launch.local_worker",
                           str(spec)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_stop_during_garbage_collection_is_delivered_after_it(tmp_path):
    """A SIGTERM or Ctrl-C that landed in a finalizer was printed as "Exception ignored" and
    lost: the worker trained the next runs until the driver killed it. In the local worker's
    own process, as it runs (its handler must be the module's the worker imports)."""
    done = run_local_worker("stop_inside_a_hold", tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert (tmp_path / "held").exists() and not (tmp_path / "after").exists()
    assert "Exception ignored" not in done.stderr


def test_a_second_stop_while_the_worker_exits_prints_no_traceback(tmp_path):
    done = run_local_worker("stopped_twice", tmp_path)
    assert done.returncode == 128 + signal.SIGINT, done.stderr  # the first stop's status
    assert not (tmp_path / "after").exists()
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


def test_a_vocabulary_the_disk_cannot_hold_leaves_no_part_behind(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat.\nthe dog sat on the log.\n" * 50)

    def full(source, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("bertforge.pipelines.vocab.os.replace", full)
    with pytest.raises(OSError):
        train_wordpiece_vocab(VocabConfig(inputs=(str(corpus),), output=str(tmp_path / "v"),
                                          vocab_size=200))
    assert os.listdir(tmp_path / "v") == []
