"""`bertforge submit` against a real `ray start --head` on 127.0.0.1."""

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.submit import SubmitConfig, describe_runtime_env
from tests.training.conftest import write_dataset

pytestmark = pytest.mark.slow
REPO = __file__.rsplit("/tests/", 1)[0]


def test_training_job_runs_to_success_with_logs_followed(ray_head, tmp_path, capsys):
    url, _ = ray_head
    data = write_dataset(str(tmp_path / "shards"), {"train": [40], "validation": [8]},
                         max_seq_length=64)
    code = main([
        "submit", "--address", url, "--working-dir", REPO, "--submission-id", "bf-train-1",
        "--env", "BERTFORGE_SECRET=hunter2", "--",
        "python", "-m", "bertforge.cluster.cli", "train", "--address", "auto", "--data", data,
        "--run-dir", str(tmp_path / "run"), "--steps", "4", "--workers", "1",
        "--batch-size", "8", "--warmup-steps", "1",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert "job bf-train-1 submitted" in out and "job bf-train-1 SUCCEEDED" in out
    assert "[train] step 4/4" in out  # the job's own logs reached us
    assert "hunter2" not in out  # credentials never printed
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "COMMITTED").exists()


def test_failing_job_gives_a_failing_exit_code(ray_head, capsys):
    url, _ = ray_head
    code = main(["submit", "--address", url, "--working-dir", REPO, "--",
                 "python", "-c", "'import sys; sys.exit(7)'"])
    assert code == 1
    assert "FAILED" in capsys.readouterr().out


def test_running_job_can_be_stopped(ray_head, capsys):
    url, _ = ray_head
    assert main(["submit", "--address", url, "--working-dir", REPO, "--no-wait",
                 "--submission-id", "bf-sleeper", "--",
                 "python", "-c", "'import time; time.sleep(120)'"]) == 0
    assert main(["submit", "--address", url, "--stop", "bf-sleeper"]) == 3
    assert "bf-sleeper STOPPED" in capsys.readouterr().out


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
