"""Real local `bertforge train` runs (2 workers, real Ray and DeepSpeed), watched from outside as
a user and a scheduler see it:
- nothing listens beyond loopback, workers included;
- a second `train` on its run directory is refused before it starts any Ray;
- SIGTERM (what a scheduler, `timeout` or `docker stop` sends) exits 143 with one line naming
  the newest committed checkpoint; the lock, Ray and its workers are gone; Ctrl-C (SIGINT)
  likewise, with 130;
- the same command then resumes from that checkpoint, its console the project's lines only
  (the engines' output is in the run's logs, cluster.launch.worker_output), until Ctrl-C
  stops it as SIGTERM does;
- `eval` and `export` of the run are quiet too, and `--verbose` shows the engines' output;
- no `pymp-*` folder of Ray's dashboard is left in TMPDIR.
Two runs serve every check: each Ray start costs tens of seconds of the suite."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from bertforge.cluster.safety.run_lock import LOCK_NAME
from bertforge.training.checkpoint import COMMIT_MARKER
from tests.support.console import BERTFORGE, foreign_lines, json_lines
from tests.support.train_process import LOOPBACK, TrainProcess, listening_sockets, train_command
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow

# DeepSpeed's logger, on importing it: the engine output every command here causes.
DEEPSPEED_NOTICE = "accelerator to"  # "Setting accelerator to CPU" here


@pytest.fixture(scope="module")
def tmpdir():
    # Short: Ray's unix socket paths live under it and are limited to 107 characters.
    path = tempfile.mkdtemp(prefix="bfq", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(*args: str, tmpdir: str) -> subprocess.CompletedProcess:
    """A `bertforge` command with its own TMPDIR (so its local Ray's sessions are its own)."""
    return subprocess.run([BERTFORGE, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": tmpdir})


@pytest.fixture(scope="module")
def observed(tmpdir):
    """What the run, the refused second run, the SIGTERM, the resume and its Ctrl-C showed."""
    data = write_dataset(os.path.join(tmpdir, "data"),
                         {"train": [300, 300], "validation": [16]}, max_seq_length=64)
    # Relative paths, as anyone types them: they are the user's directory's, not the workers'.
    # Two workers: gloo's pair sockets and torch's rendezvous store between them.
    command = train_command("data", "run", workers=2) + ["--checkpoint-every", "10"]
    seen: dict = {"data": data, "run_dir": os.path.join(tmpdir, "run")}
    with TrainProcess(command, cwd=tmpdir) as run_:
        run_.wait_for(os.path.join(run_.run_dir, "checkpoints", "step_00000010", COMMIT_MARKER))
        seen["listening"] = set()
        for _ in range(3):  # a few looks while it trains (workers, agents, actors)
            seen["listening"] |= set(listening_sockets(run_.tree()))
            time.sleep(1.0)

        second = subprocess.Popen(command, env=run_.env, cwd=tmpdir, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        seen["second"] = second.communicate(timeout=300)[1], second.returncode
        # Refused before Ray started: no session of its own (Ray names them ..._PID).
        seen["second_sessions"] = [name for name in os.listdir(run_.ray_root)
                                   if name.endswith(f"_{second.pid}")]
        seen["driver_pid"] = run_.process.pid

        run_.tree()  # every process of the run, to look for survivors
        run_.process.send_signal(signal.SIGTERM)
        seen["stopped"] = run_.process.wait(timeout=120), run_.stderr()
        # None the moment the driver exited: its workers could still write a checkpoint.
        seen["survivors"] = run_.survivors(timeout_s=0)
        seen["lock_left"] = os.path.exists(os.path.join(run_.run_dir, LOCK_NAME))
        seen["multiprocessing_dirs"] = _multiprocessing_dirs(run_.tmpdir)
    seen["newest"] = _newest_named(seen["stopped"][1])

    # The same command resumes; Ctrl-C (SIGINT to the driver) once the resumed run has
    # committed a checkpoint of its own. (Its console to a run's end: test_readme_on_a_clone.)
    resumed_at = int(seen["newest"].rsplit("_", 1)[-1])
    seen["next_save"] = (resumed_at // 10 + 1) * 10
    with TrainProcess(command, cwd=tmpdir) as run_:
        run_.wait_for(os.path.join(run_.run_dir, "checkpoints",
                                   f"step_{seen['next_save']:08d}", COMMIT_MARKER))
        run_.tree()
        run_.process.send_signal(signal.SIGINT)
        seen["interrupted"] = run_.process.wait(timeout=120), run_.stderr()
        seen["interrupted_stdout"] = run_.stdout()
        seen["interrupted_survivors"] = run_.survivors(timeout_s=0)
        seen["interrupted_lock_left"] = os.path.exists(os.path.join(run_.run_dir, LOCK_NAME))
        seen["multiprocessing_dirs"] += _multiprocessing_dirs(run_.tmpdir)

        # The run asked to end where its newest checkpoint is: nothing to train, and no Ray.
        newest = _newest_named(seen["interrupted"][1])
        steps = int(newest.rsplit("_", 1)[-1])
        at_its_end = command[:command.index("--max-steps") + 1] + [str(steps)] + \
            command[command.index("--max-steps") + 2:]
        sessions = set(os.listdir(run_.ray_root))
        finished = subprocess.Popen(at_its_end, env=run_.env, cwd=tmpdir,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen["finished"] = finished.communicate(timeout=120), finished.returncode
        seen["finished_steps"] = steps
        seen["finished_sessions"] = set(os.listdir(run_.ray_root)) - sessions
    return seen


def _newest_named(stderr: str) -> str:
    """The checkpoint a stopped train's last line names."""
    last = stderr.strip().splitlines()[-1]
    return last.split("newest committed checkpoint ")[-1].split(";")[0]


def _multiprocessing_dirs(tmpdir: str) -> list[str]:
    return [name for name in os.listdir(tmpdir) if name.startswith("pymp-")]


def test_a_local_run_listens_on_loopback_only(observed):
    names = " ".join(name for name, _, _ in observed["listening"])
    assert "RayTrainWorker" in names and "raylet" in names and "gcs_server" in names
    exposed = sorted(entry for entry in observed["listening"] if entry[1] not in LOOPBACK)
    assert not exposed, f"listening beyond the loopback address: {exposed}"


def test_a_second_train_on_its_run_directory_is_refused_before_it_starts_ray(observed):
    stderr, returncode = observed["second"]
    assert returncode == 2, stderr
    assert (f"another bertforge train is running in {observed['run_dir']} (host "
            f"{socket.gethostname()}, pid "
            f"{observed['driver_pid']}, since 20") in stderr
    assert observed["second_sessions"] == []


def test_sigterm_stops_with_one_line_and_leaves_no_process_and_no_lock(observed):
    returncode, stderr = observed["stopped"]
    assert returncode == 143, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("bertforge train: stopped by SIGTERM; newest committed checkpoint "
                           f"{observed['run_dir']}/checkpoints/step_"), stderr
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr
    assert not observed["survivors"], "running after the SIGTERMed driver exited"
    assert not observed["lock_left"], "the lock outlived a SIGTERMed run"


def test_ctrl_c_stops_as_sigterm_does(observed):
    """Ray Train's fit() put its own SIGINT handler in place of the driver's: Ctrl-C ended the
    run with exit code 1 and not a line (its handler's sys.exit inside ray.get)."""
    returncode, stderr = observed["interrupted"]
    assert returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("bertforge train: stopped by SIGINT; newest committed checkpoint "
                           f"{observed['run_dir']}/checkpoints/step_"), stderr
    assert "Traceback" not in stderr
    assert not observed["interrupted_survivors"], "running after the interrupted driver exited"
    assert not observed["interrupted_lock_left"], "the lock outlived an interrupted run"


def test_the_same_command_resumes_and_prints_only_its_own_lines(observed):
    stdout, stderr = observed["interrupted_stdout"], observed["interrupted"][1]
    assert f"[train] resumed from {observed['newest']}" in stdout
    assert foreign_lines(stdout, []) == []
    assert stderr.strip().startswith("bertforge train: stopped by SIGINT") and \
        len(stderr.strip().splitlines()) == 1, stderr
    assert "(RayTrainWorker" not in stdout
    logs = os.path.join(observed["run_dir"], "logs")
    driver_log = open(os.path.join(logs, "train.log"), encoding="utf-8").read()
    assert "(RayTrainWorker pid=" in driver_log  # Ray's own forwarding, kept in the file
    worker_log = open(os.path.join(logs, "worker-0.log"), encoding="utf-8").read()
    assert f"[train] step {observed['next_save']}/" in worker_log


def test_a_stopped_local_ray_leaves_no_multiprocessing_folder(observed):
    """Ray's dashboard left a `pymp-*` folder with a dead socket in TMPDIR at every run (its
    forkserver's; 584 of them on one machine): each stop now removes its own."""
    assert observed["multiprocessing_dirs"] == []


def test_the_same_command_on_a_finished_run_says_so_without_starting_ray(observed):
    (stdout, stderr), returncode = observed["finished"]
    steps = observed["finished_steps"]
    assert returncode == 0 and stderr == "", stderr
    assert f"is at step {steps} of {steps}: nothing to train" in stdout
    assert json.loads("\n".join(json_lines(stdout)))["step"] == steps
    assert observed["finished_sessions"] == set()  # no Ray session of its own


def test_eval_shows_progress_is_limited_by_max_batches_and_prints_only_its_own(observed,
                                                                             tmpdir):
    result = run("eval", observed["run_dir"], "--data", observed["data"], "--batch-size", "2",
                 "--max-batches", "3", tmpdir=tmpdir)
    assert result.returncode == 0, result.stdout + result.stderr
    # stdout is the result alone (`> result.json`), its lines are on stderr.
    assert json.loads(result.stdout)["num_sequences"] == 6
    assert foreign_lines(result.stderr, []) == []
    assert ": 6 sequences of the validation split in 3 batches of 2\n" in result.stderr
    # DeepSpeed's logger (imported to read the checkpoint) went to the run's log instead.
    log = open(os.path.join(observed["run_dir"], "logs", "eval.log"), encoding="utf-8").read()
    assert DEEPSPEED_NOTICE in log


def test_export_is_quiet_and_verbose_shows_the_engines_output(observed, tmpdir):
    run_dir = observed["run_dir"]
    quiet = run("export", run_dir, "--output", os.path.join(tmpdir, "hf"), tmpdir=tmpdir)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert quiet.stdout == os.path.join(tmpdir, "hf") + "\n"  # the path alone, for a script
    assert foreign_lines(quiet.stderr, []) == []
    # It names the run and step whose weights it exported.
    assert re.search(r"^\[export\] run \d{8}T\d{6}\.\d{3}Z, step \d+, from ", quiet.stderr,
                     re.MULTILINE), quiet.stderr
    # The same command with --verbose: the chatter this test would catch is on the console.
    verbose = run("export", run_dir, "--output", os.path.join(tmpdir, "hf2"), "--verbose",
                  tmpdir=tmpdir)
    assert verbose.returncode == 0, verbose.stdout + verbose.stderr
    chatter = foreign_lines(verbose.stdout, [os.path.join(tmpdir, "hf2")]) + \
        foreign_lines(verbose.stderr, [])
    assert any(DEEPSPEED_NOTICE in line for line in chatter), chatter
    log = open(os.path.join(run_dir, "logs", "export.log"), encoding="utf-8").read()
    assert log.count(DEEPSPEED_NOTICE) == 2  # both runs' (appended)
