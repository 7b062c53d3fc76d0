"""`cluster.launch.local_worker`: fine-tuning's one local CPU worker, in a child process
without Ray."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import psutil
import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.cluster.launch.local_worker import run_in_local_process, runs_in_one_local_process
from bertforge.training.errors import RestartsUsedUp, UserInputError
from tests.support import local_workers
from tests.support.finetune_data import tiny_bert_dir, write_sst2_tsv


def test_only_one_cpu_worker_without_a_cluster_runs_outside_ray() -> None:
    assert runs_in_one_local_process(LaunchConfig(workers=1, cpus_per_worker=2))
    assert not runs_in_one_local_process(LaunchConfig(workers=2))
    assert not runs_in_one_local_process(LaunchConfig(workers=1, gpu=True))
    assert not runs_in_one_local_process(LaunchConfig(workers=1, address="auto"))


def test_a_user_error_in_the_worker_ends_at_once_with_its_message(tmp_path) -> None:
    launch = LaunchConfig(workers=1, max_failures=3)
    with pytest.raises(UserInputError, match="no such column 'label' in the data"):
        run_in_local_process(local_workers.refuse_the_inputs, {"column": "label"}, launch,
                             str(tmp_path))


def test_a_crashed_worker_is_started_again_with_its_threads_and_its_lines_relayed(
        tmp_path, capsys) -> None:
    launch = LaunchConfig(workers=1, cpus_per_worker=3, max_failures=1)
    run_in_local_process(local_workers.crash_once_then_finish, {"dir": str(tmp_path)}, launch,
                         str(tmp_path))
    threads, parent = (tmp_path / "done").read_text().split()
    assert threads == "3" and int(parent) == os.getpid()
    captured = capsys.readouterr()
    assert "working\n" in captured.out and "[finetune] the worker's own line\n" in captured.out
    assert ("bertforge: the local worker stopped (exit status 9); starting it again "
            "(attempt 2 of 2)") in captured.err


def test_a_worker_that_keeps_failing_fails_the_command_after_its_restarts(tmp_path,
                                                                         capsys) -> None:
    launch = LaunchConfig(workers=1, max_failures=0)
    with pytest.raises(RestartsUsedUp, match=r"failed 1 time, more than --max-failures 0 "
                                             r"allows \(the last: exit status 9;") as error:
        run_in_local_process(local_workers.crash_once_then_finish, {"dir": str(tmp_path)},
                             launch, str(tmp_path))
    assert error.value.__cause__ is None  # nothing to report but its line
    assert "working\n" in capsys.readouterr().out  # what the worker said came through


def test_a_local_fine_tuning_whose_worker_keeps_dying_ends_with_one_line(tmp_path, monkeypatch,
                                                                        capsys) -> None:
    """It ended with the driver's traceback (cli, finetune_sweep, local_worker frames) after
    the worker's own report: Ray Train's used-up restarts end with one line of ours. The
    worker's crash report stays (relayed as it came); then one line, exit status 1."""
    from bertforge.cluster.commands import finetune_sweep
    from tests.support.finetune_data import tiny_bert_dir, write_sst2_tsv

    monkeypatch.setattr(finetune_sweep, "_worker_main", local_workers.always_crash)
    output = str(tmp_path / "ft")
    status = main(["finetune", "--task", "sst2", "--model", tiny_bert_dir(str(tmp_path / "m")),
                   "--train", write_sst2_tsv(str(tmp_path / "train.tsv"), 16, 0),
                   "--dev", write_sst2_tsv(str(tmp_path / "dev.tsv"), 8, 1),
                   "--output", output, "--max-failures", "1", "--max-steps", "2",
                   "--batch-size", "8"])
    captured = capsys.readouterr()
    assert status == 1, captured.err
    err = captured.err.strip().splitlines()
    assert "[finetune] working" in captured.out
    assert "RuntimeError: the worker's own crash" in err  # the worker's report, relayed
    assert err.count("Traceback (most recent call last):") == 2  # one per attempt: its own
    assert not [line for line in err if "cluster/cli.py" in line or "finetune_sweep.py" in line
                or "in run_in_local_process" in line]  # the driver's frames
    assert err[-1] == (
        "bertforge finetune: error: the local worker failed 2 times, more than --max-failures 1 "
        "allows (the last: exit status 1; its output is above, its log in "
        f"{os.path.join(output, 'runs')}); the same command runs again what did not finish "
        "(each finished run is reused)")


def test_the_worker_makes_its_own_group_whatever_group_the_driver_is_in(tmp_path,
                                                                        monkeypatch) -> None:
    """A driver that trained in-process holds a 1-rank group whose port is in its environment
    (training.engine.ensure_process_group), as torchrun's variables would be: the worker must
    not try to join it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        run_in_local_process(local_workers.join_a_process_group, {"dir": str(tmp_path)},
                             LaunchConfig(workers=1, max_failures=0), str(tmp_path))
    assert (tmp_path / "group").read_text() == "0 1"


@pytest.mark.slow
def test_a_local_finetune_starts_no_ray_and_a_killed_worker_redoes_its_run(tmp_path, capsys,
                                                                           monkeypatch):
    """The default local `finetune` (one worker): no Ray at all; SIGKILL its worker mid-run and
    the same command finishes, the run started over (one attempt's steps in its metrics), and
    the killed worker's scratch copy of the vocabulary is gone with it (it stayed in /tmp)."""
    import ray

    worker_tmp = tmp_path / "tmp"  # the worker process's temporary directory
    worker_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(worker_tmp))

    model = tiny_bert_dir(str(tmp_path / "model"))
    train = write_sst2_tsv(str(tmp_path / "train.tsv"), 512, seed=1)
    dev = write_sst2_tsv(str(tmp_path / "dev.tsv"), 32, seed=2)
    output = str(tmp_path / "out")
    run_dir = os.path.join(output, "runs", "lr0.001-seed3")
    killed: list[int] = []

    def kill_the_worker_once_it_trains() -> None:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.time() + 300
        while time.time() < deadline and not (os.path.exists(metrics)
                                              and os.path.getsize(metrics)):
            time.sleep(0.05)
        for child in psutil.Process().children(recursive=True):
            # An earlier test's child this process has not reaped yet is a zombie: skip it.
            with contextlib.suppress(psutil.Error):
                if "bertforge.cluster.launch.local_worker" in " ".join(child.cmdline()):
                    child.kill()
                    killed.append(child.pid)

    killer = threading.Thread(target=kill_the_worker_once_it_trains)
    killer.start()
    status = main(["finetune", "--task", "sst2", "--model", model, "--output", output,
                   "--train", train, "--dev", dev, "--batch-size", "8", "--epochs", "3",
                   "--lr", "1e-3", "--seeds", "3", "--log-every", "1"])
    killer.join()
    assert status == 0 and len(killed) == 1
    assert not ray.is_initialized()
    captured = capsys.readouterr()
    assert "1 run(s) in one local worker process (lr0.001-seed3)" in captured.out
    assert "the local worker stopped (killed by SIGKILL); starting it again" in captured.err
    with open(os.path.join(output, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    assert results["training"]["world_size"] == 1 and 0 <= results["score"] <= 1
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, results["training"]["steps"] + 1))
    # The worker's lines came through the driver: its own, a step line among them.
    assert "[finetune] step 1/" in captured.out
    # One line for the finished run, the worker's, with its score (not a second one from the
    # stage that records it).
    finished = [line for line in captured.out.splitlines() if "finished in" in line]
    assert len(finished) == 1 and "(accuracy " in finished[0], finished
    assert not [p for p in psutil.Process().children(recursive=True)
                if "local_worker" in " ".join(p.cmdline())]
    assert not list(worker_tmp.glob("bertforge-finetune-*"))
    assert not [name for name in os.listdir(run_dir) if name.startswith(".scratch-")]
