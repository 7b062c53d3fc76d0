"""Which rank uploads which checkpoint files to Ray Train storage. The end-to-end restore from
storage (a worker killed, the node's local checkpoints gone) is in test_fault_tolerance.py, where
it shares the uninterrupted reference run and the local Ray."""

from bertforge.cluster.launch.persistence import (
    files_of_rank,
    storage_run_name,
    stored_checkpoints,
)


def test_each_rank_uploads_exactly_its_own_files():
    names = ["COMMITTED", "bertforge.json", "vocab.txt", "mp_rank_00_model_states.pt",
             "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
             "bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt",
             "rng_rank_00000.pt", "rng_rank_00001.pt", "rng_rank_00012.pt"]
    per_rank = {rank: files_of_rank(names, rank) for rank in (0, 1, 12)}
    assert per_rank[1] == ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank_00001.pt"]
    assert per_rank[12] == ["bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt",
                            "rng_rank_00012.pt"]
    assert "COMMITTED" in per_rank[0] and "mp_rank_00_model_states.pt" in per_rank[0]
    assert sorted(sum(per_rank.values(), [])) == sorted(names)  # nothing lost, nothing twice


def test_runs_named_alike_have_their_own_runs_in_storage(tmp_path):
    """Every pipeline's runs are WORKDIR/runs/phase1: named by the last component alone, two
    of them shared one run in --storage and restored each other's checkpoints."""
    first, second = (storage_run_name(str(tmp_path / work / "runs" / "phase1"))
                     for work in ("a", "b"))
    assert first != second and first.startswith("phase1-") and second.startswith("phase1-")
    assert storage_run_name(str(tmp_path / "a" / "runs" / "phase1") + "/") == first
    assert stored_checkpoints(str(tmp_path / "storage"), first) == []  # nothing there yet
    for name in ("step_00000010", "step_00000020", "checkpoint_tmp", ".upload"):
        (tmp_path / "storage" / first / name).mkdir(parents=True)
    assert stored_checkpoints(str(tmp_path / "storage"), first) == ["step_00000010",
                                                                     "step_00000020"]


def test_a_resubmitted_job_finds_its_run_in_storage_and_other_directories_do_not(
        tmp_path, monkeypatch):
    """Inside a `submit` job a relative --run-dir resolves under the job's uploaded working
    directory, another one at each submission: named relative to it, the resubmitted run
    finds its checkpoints. Anywhere else the same relative path from two directories is two
    runs."""
    # Where Ray unpacks each submission's working directory.
    uploads = tmp_path / "ray" / "session_1" / "runtime_resources" / "working_dir_files"
    first, second = uploads / "_ray_pkg_1", uploads / "_ray_pkg_2"
    first.mkdir(parents=True)
    second.mkdir()
    shared = str(tmp_path / "shared" / "bert")
    shared_anywhere = storage_run_name(shared)
    elsewhere = tmp_path / "a", tmp_path / "b"
    for directory in elsewhere:
        directory.mkdir()
    monkeypatch.chdir(elsewhere[0])
    outside = storage_run_name("runs/bert")
    monkeypatch.chdir(elsewhere[1])
    assert storage_run_name("runs/bert") != outside
    monkeypatch.chdir(second)
    in_second_job = storage_run_name("runs/bert")
    monkeypatch.chdir(first)
    assert storage_run_name("./runs/bert/") == in_second_job
    # A job that changed directory names the path by where it lies, not by where it runs.
    monkeypatch.chdir(tmp_path)
    assert storage_run_name(str(second / "runs" / "bert")) == in_second_job
    # An absolute path outside the job's directory is named by itself, as anywhere.
    assert storage_run_name(shared) == shared_anywhere
