"""`bertforge submit` against a real two-node Ray cluster started on this machine: `ray start
--head` plus a second `ray start --address`, each node on its own loopback address with one CPU.
One cluster serves the module: each start costs tens of seconds of the suite."""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.launch.checkout import package_folders
from bertforge.cluster.launch.paths import jobs_copy_of
from bertforge.cluster.launch.submit import (
    DEFAULT_ADDRESS,
    DEFAULT_EXCLUDES,
    SubmitConfig,
    describe_runtime_env,
    entrypoint_command,
    jobs_address,
    jobs_client,
    shipped_package,
)
from bertforge.training.checkpoint import latest_checkpoint, read_metadata
from bertforge.training.errors import UserInputError
from bertforge.training.metrics import read_metrics
from tests.support.train_process import sigint_as_in_a_terminal
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow
REPO = __file__.rsplit("/tests/", 1)[0]
PACKAGE_FOLDERS = package_folders(REPO)


def test_training_spans_two_nodes_through_a_submitted_job_with_logs_followed(two_node_cluster,
                                                                            tmp_path):
    data = write_dataset(str(tmp_path / "shards"), {"train": [80, 80], "validation": [16]},
                         max_seq_length=64)
    run_dir = tmp_path / "run"
    # Each node offers 1 CPU and each worker takes 1: the two workers must sit on different
    # nodes, so the gradients cross between raylets (gloo over 127.0.0.2 <-> 127.0.0.3).
    command = [
        sys.executable, "-m", "bertforge.cluster.cli", "submit", "--address",
        two_node_cluster.dashboard_url, "--working-dir", REPO, "--submission-id", "bf-train-1",
        "--env", "BERTFORGE_SECRET=hunter2", "--",
        "python", "-m", "bertforge.cluster.cli", "train", "--address", "auto", "--data", data,
        "--run-dir", str(run_dir), "--steps", "12", "--workers", "2", "--cpus-per-worker", "1",
        "--batch-size", "8", "--warmup-steps", "2", "--checkpoint-every", "6",
    ]
    # This process imported Ray without the token mode; the client of a fresh one needs it.
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=480)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "job bf-train-1 submitted" in out and "job bf-train-1 SUCCEEDED" in out
    assert "[train] step 12/12" in out  # the job's own logs reached us
    assert "hunter2" not in out + result.stderr  # credentials never printed
    final = latest_checkpoint(str(run_dir))  # the newest committed one
    assert read_metadata(final)["global_step"] == 12
    assert read_metadata(final)["world_size"] == 2
    history = read_metrics(str(run_dir))
    assert history[-1]["step"] == 12 and history[-1]["loss"] < history[0]["loss"]


# Run by the job from its working dir: which bertforge do the driver and a Ray worker import?
PROBE = """
import os
import ray
import bertforge.training as training

@ray.remote
def in_a_worker():
    import bertforge.training as training
    return training.UPLOADED, os.listdir(os.path.dirname(training.__file__))

ray.init()
marker, files = ray.get(in_a_worker.remote())
print("driver:", training.UPLOADED, "worker:", marker, "arrow:", "big.arrow" in files)
"""


def _checkout_copy(root) -> str:
    """A bertforge checkout whose training/ differs from the installed one: it alone has
    UPLOADED (and a file the default excludes keep out)."""
    os.makedirs(root)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(REPO, name), root)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(os.path.join(REPO, folder), os.path.join(root, folder),
                        ignore=shutil.ignore_patterns("__pycache__"))
    with open(os.path.join(root, "training", "__init__.py"), "a", encoding="utf-8") as f:
        f.write('\nUPLOADED = "from-the-working-dir"\n')
    with open(os.path.join(root, "training", "big.arrow"), "wb") as f:
        f.write(b"not uploaded")
    with open(os.path.join(root, "probe.py"), "w", encoding="utf-8") as f:
        f.write(PROBE)
    return str(root)


def test_job_runs_the_uploaded_checkout_not_the_installed_package(two_node_cluster, tmp_path,
                                                                   capsys):
    url = two_node_cluster.dashboard_url
    checkout = _checkout_copy(tmp_path / "checkout")
    code = main(["submit", "--address", url, "--working-dir", checkout, "--",
                 "python", "probe.py"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "driver: from-the-working-dir worker: from-the-working-dir arrow: False" in out
    assert f"bertforge (pipelines, training, cluster of {checkout})" in out


def test_only_a_bertforge_checkout_is_shipped_as_the_package(tmp_path):
    assert PACKAGE_FOLDERS == ("pipelines", "training", "cluster")
    own = tmp_path / "own"  # a user's project with folders of the same names
    for folder in PACKAGE_FOLDERS:
        (own / folder).mkdir(parents=True)
        (own / folder / "__init__.py").write_text("")
    (own / "pyproject.toml").write_text('[project]\nname = "my-bert"\n')
    assert package_folders(str(own)) is None
    with shipped_package(str(own)) as package:
        assert package is None
    assert "py_modules" not in SubmitConfig(["x"], working_dir=str(own)).runtime_env()
    with shipped_package(REPO) as package:
        assert os.path.basename(package) == "bertforge"
        assert not os.path.exists(os.path.join(package, "__init__.py"))  # a namespace portion
        assert sorted(os.listdir(package)) == sorted(PACKAGE_FOLDERS)
        # What a wheel holds: modules and package data, never the checkout's other files.
        assert os.path.isfile(os.path.join(package, "cluster", "cli.py"))
        assert not [name for _, _, names in os.walk(package) for name in names
                    if not name.endswith((".py", ".tsv", ".md"))]
        env = SubmitConfig(["x"], working_dir=REPO).runtime_env(package)
        assert env["py_modules"] == [package] and env["working_dir"] == REPO
    assert not os.path.exists(package)


def test_failing_job_gives_a_failing_exit_code(two_node_cluster, capsys):
    url = two_node_cluster.dashboard_url
    code = main(["submit", "--address", url, "--working-dir", REPO, "--",
                 "python", "-c", "import sys; sys.exit(7)"])  # as a shell hands the words on
    assert code == 1
    assert "FAILED" in capsys.readouterr().out
    # A relative --run-dir in a real job (past the command check, which refuses it first):
    # Ray's copy of the working directory is recognised.
    code = main(["submit", "--address", url, "--working-dir", REPO, "--no-command-check",
                 "--", "python", "-m",
                 "bertforge.cluster.cli", "train", "--address", "auto", "--data", "/no/data",
                 "--run-dir", "runs/rel"])
    assert code == 1
    out = capsys.readouterr().out
    assert re.search(r"bertforge train: error: --run-dir runs/rel is inside this job's uploaded "
                     r"copy of its working directory \(\S+/working_dir_files/_ray_pkg_\w+\), "
                     "which Ray deletes", out), out[-3000:]


def test_running_job_can_be_followed_again_and_stopped(two_node_cluster, capsys):
    url = two_node_cluster.dashboard_url
    # It ends, as a bertforge command does when stopped, with a line of its own.
    assert main(["submit", "--address", url, "--working-dir", REPO, "--no-wait",
                 "--submission-id", "bf-sleeper", "--",
                 "python", "-c", "import signal, sys, time\n"
                 "def stop(*_):\n"
                 "    print('bertforge sleep: stopped by SIGTERM; slept enough', flush=True)\n"
                 "    sys.exit(143)\n"
                 "signal.signal(signal.SIGTERM, stop)\n"
                 "print('as' + 'leep', flush=True)\n"
                 "time.sleep(120)"]) == 0
    assert (f"`bertforge submit --address {url} --follow bf-sleeper` follows it, `bertforge "
            f"submit --address {url} --stop bf-sleeper` stops it") in capsys.readouterr().out
    # Ctrl-C while following stops the following, not the job, and says how to reach it.
    follower = subprocess.Popen(
        [sys.executable, "-m", "bertforge.cluster.cli", "submit", "--address", url,
         "--follow", "bf-sleeper"], env={**os.environ, "RAY_AUTH_MODE": "token"}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_as_in_a_terminal)  # a runner's ignored SIGINT would pass on
    lines = []
    while "asleep\n" not in lines:  # its logs from the start reached us (not the command's)
        lines.append(follower.stdout.readline())
        assert lines[-1], "".join(lines) + follower.stderr.read()
    follower.send_signal(signal.SIGINT)
    out, err = follower.communicate(timeout=60)
    assert follower.returncode == 130, err
    assert err.strip() == ("bertforge submit: stopped by SIGINT; job bf-sleeper keeps running; "
                           f"`bertforge submit --address {url} --follow bf-sleeper` follows it, "
                           f"`bertforge submit --address {url} --stop bf-sleeper` stops it")
    assert main(["submit", "--address", url, "--stop", "bf-sleeper"]) == 3
    # What the job said last, which told a stopped `train`'s checkpoint, was in its logs alone.
    assert capsys.readouterr().out == (
        "[submit] job bf-sleeper STOPPED\n[submit] job bf-sleeper ended with: bertforge sleep: "
        "stopped by SIGTERM; slept enough\n")
    # An id used before, and one the cluster never had: one line each, not Ray's traceback.
    for argv, expected in (
            (["--working-dir", REPO, "--no-wait", "--submission-id", "bf-sleeper", "--",
              "true"], "the cluster refused the job: Job with submission_id bf-sleeper already "
                       "exists. Please use a different submission_id. (an id names one job"),
            (["--stop", "bf-no-such-job"], "cannot stop job bf-no-such-job: "),
            (["--follow", "bf-no-such-job"], "cannot follow job bf-no-such-job: ")):
        assert main(["submit", "--address", url, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"bertforge submit: error: {expected}") and "\n" not in err, err


def test_the_job_goes_where_the_command_says(two_node_cluster, tmp_path, monkeypatch,
                                            capsys):
    """Ray's client honours RAY_ADDRESS (and RAY_API_SERVER_ADDRESS): the job went to the
    cluster it names while the command said `submitted to http://127.0.0.1:8265` and told the
    user to follow it there, where no cluster answered. An --address given wins over both."""
    url = two_node_cluster.dashboard_url
    monkeypatch.setenv("RAY_ADDRESS", url)
    assert main(["submit", "--working-dir", str(tmp_path), "--no-wait", "--submission-id",
                 "bf-env-address", "--", "true"]) == 0
    out = capsys.readouterr().out
    assert f"job bf-env-address submitted to {url} " in out, out
    assert f"`bertforge submit --address {url} --follow bf-env-address` follows it" in out, out
    assert main(["submit", "--follow", "bf-env-address"]) == 0
    assert "job bf-env-address SUCCEEDED" in capsys.readouterr().out
    elsewhere = "http://127.0.0.1:9"  # nothing answers there
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", elsewhere)
    assert main(["submit", "--address", url, "--follow", "bf-env-address"]) == 0
    assert "job bf-env-address SUCCEEDED" in capsys.readouterr().out
    # HOST:PORT, as `ray dashboard` prints it, is the dashboard's http address (Ray's client
    # took it for a GCS address: 40 s, then a traceback).
    host_port = url.removeprefix("http://")
    assert main(["submit", "--address", host_port, "--follow", "bf-env-address"]) == 0
    assert "job bf-env-address SUCCEEDED" in capsys.readouterr().out
    # A stop of a job that had ended says so (its status alone read as if the stop ended it).
    assert main(["submit", "--address", url, "--stop", "bf-env-address"]) == 0
    assert capsys.readouterr().out == ("[submit] job bf-env-address had already ended: nothing "
                                       "to stop\n[submit] job bf-env-address SUCCEEDED\n")


def test_the_jobs_address_is_resolved_once_as_rays_client_would():
    assert jobs_address(None, {}) == DEFAULT_ADDRESS
    assert jobs_address(None, {"RAY_ADDRESS": "http://h:1"}) == "http://h:1"
    assert jobs_address(None, {"RAY_ADDRESS": "http://h:1",
                               "RAY_API_SERVER_ADDRESS": "http://h:2"}) == "http://h:2"
    assert jobs_address("http://h:3", {"RAY_ADDRESS": "http://h:1"}) == "http://h:3"
    assert jobs_address("127.0.0.1:8275", {}) == "http://127.0.0.1:8275"
    # A variable that is no http address is a GCS address, for ray.init (a head node's
    # RAY_ADDRESS=127.0.0.1:6379): not the Jobs API's.
    assert jobs_address(None, {"RAY_ADDRESS": "h:6379"}) == DEFAULT_ADDRESS
    assert jobs_address(None, {"RAY_ADDRESS": "auto"}) == DEFAULT_ADDRESS
    assert jobs_address(None, {"RAY_ADDRESS": "http://h:1/"}) == "http://h:1"
    assert jobs_address("https://ray.example.com/", {}) == "https://ray.example.com"
    for given in ("auto", "local", "ray://h:10001", "gs://b/x", "h:port"):
        with pytest.raises(ValueError, match=f"^--address {re.escape(given)} is no Ray "
                           "dashboard address: give the dashboard's http address"):
            jobs_address(given, {})


def test_outputs_inside_a_jobs_copy_of_its_working_dir_are_refused(tmp_path, monkeypatch,
                                                                   capsys):
    """Inside a submitted job a relative path lands in the job's uploaded copy of its working
    directory, which Ray deletes: a run written there was lost, and a resubmitted `--resume
    auto` started over without a word. (A real job's refusal: the two-node test above.)"""
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab12"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    data = write_dataset(str(tmp_path / "shards"), {"train": [16]}, max_seq_length=32)
    refused = [
        (["train", "--data", data, "--run-dir", "runs/rel"], "--run-dir runs/rel"),
        (["train", "--data", data, "--run-dir", str(tmp_path / "run"), "--storage", "st"],
         "--storage st"),
        (["finetune", "--task", "sst2", "--model", data, "--output", "ft"], "--output ft"),
        (["demo"], f"--output {copy / 'bertforge-demo'}"),  # a default output too
        (["export", data, "--output", "hf"], "--output hf"),
        (["prepare", "--input", "x.jsonl", "--output", "shards", "--vocab", "v.txt"],
         "--output shards"),
    ]
    for argv, flag in refused:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bertforge {argv[0]}: error: {flag} is inside this job's "
                              f"uploaded copy of its working directory ({copy}), which Ray "
                              "deletes"), err
    assert sorted(os.listdir(copy)) == []
    # An input found missing there says where the relative path went.
    assert main(["train", "--data", "shards", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"(inside a submitted job a relative path is in the job's uploaded copy of its working "
        f"directory, {copy}: give absolute paths every node mounts)")
    # A job that changed to a shared directory writes there as it asks.
    monkeypatch.chdir(tmp_path)
    assert jobs_copy_of("runs/rel") is None and jobs_copy_of(str(copy / "runs")) == str(copy)


def test_the_job_gets_the_words_it_was_given(tmp_path):
    """Ray runs the entrypoint through a shell: a path with a space, a glob and a `;` reach
    the job as the words the user's shell gave `bertforge submit`; one word is a command line."""
    import json

    words = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))",
             "--data", str(tmp_path / "my shards"), "*", "a;b", "$HOME"]
    (tmp_path / "x.txt").write_text("")
    shell = subprocess.run(entrypoint_command(words), shell=True, cwd=tmp_path,
                           capture_output=True, text=True, check=True)
    assert json.loads(shell.stdout) == words[3:]
    assert entrypoint_command(["bertforge train --data d"]) == "bertforge train --data d"


def test_runtime_env_hides_values_and_excludes_heavy_paths(tmp_path):
    config = SubmitConfig(entrypoint=["bertforge", "train"], working_dir=str(tmp_path),
                          env_vars={"AWS_SECRET_ACCESS_KEY": "abc"})
    env = config.runtime_env()
    assert ".venv" in env["excludes"] and "*.arrow" in env["excludes"]
    assert describe_runtime_env(env)["env_vars"] == {"AWS_SECRET_ACCESS_KEY": "<hidden>"}
    with pytest.raises(ValueError, match="nothing to run"):
        SubmitConfig(entrypoint=[], working_dir=str(tmp_path))
    with pytest.raises(ValueError, match="either --image or --working-dir"):
        SubmitConfig(entrypoint=["x"], working_dir=str(tmp_path), image="repo/bertforge:1")


def test_rays_notice_of_its_default_excludes_is_not_shown(tmp_path):
    """Every submit from a checkout opened with Ray's two warnings "Directory '.git' (and
    '.venv') is now ignored by default when packaging the working directory": no news, our
    excludes leave them out anyway. Ray's own upload step, as the Jobs client runs it."""
    import logging

    from ray._private import ray_constants
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed
    from ray.util.debug import reset_log_once

    for name in (".git", ".venv", "venv", "__pycache__"):
        (tmp_path / name).mkdir()
    ours = {pattern.removeprefix("**/") for pattern in DEFAULT_EXCLUDES}
    assert set(ray_constants.get_runtime_env_default_excludes()) <= ours
    with pytest.raises(UserInputError, match="no Ray cluster answers"):
        jobs_client("http://127.0.0.1:9")  # nothing there; the client's logging is set first
    records = []
    logger = logging.getLogger("ray._private.runtime_env.working_dir")
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        reset_log_once()  # Ray warns once a process: a test before this one may have had it
        upload_working_dir_if_needed(
            SubmitConfig(["x"], working_dir=str(tmp_path)).runtime_env(),
            include_gitignore=True, upload_fn=lambda *args, **kwargs: None)
        logger.warning("another warning of Ray's still shows")
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == ["another warning of Ray's still shows"]


def test_a_bertforge_job_from_a_folder_that_is_no_checkout_uploads_nothing(tmp_path,
                                                                         monkeypatch):
    """From a folder of data and runs (not a checkout) the default uploaded it all for a job
    that runs the cluster's bertforge: 267 MiB, refused by the cluster ("413 Maximum request
    body size exceeded"). Another program still gets the folder; a checkout still ships."""
    from bertforge.cluster.launch.submit import default_working_dir

    monkeypatch.chdir(tmp_path)
    assert default_working_dir(["bertforge", "train", "--data", "/d", "--run-dir", "/r"]) is None
    assert default_working_dir(["python", "my_script.py"]) == "."
    monkeypatch.chdir(REPO)
    assert default_working_dir(["bertforge", "train"]) == "."
