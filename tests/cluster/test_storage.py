"""Checkpoints persisted through Ray Train storage: a worker dies and its node's copy of the
checkpoints is lost with it; the restarted group restores from storage and ends with the
weights of an uninterrupted run."""

import shutil
import threading

import pytest
import torch

from bertforge.cluster.persistence import files_of_rank
from bertforge.cluster.ray_train import LaunchConfig, train_on_ray
from bertforge.training.checkpoint import load_fp32_state_dict
from tests.cluster.test_fault_tolerance import KILL_AT_STEP, kill_a_worker_after, recipe
from tests.training.conftest import write_dataset


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


def kill_worker_and_lose_local_checkpoints(run_dir, killed: list) -> None:
    kill_a_worker_after(run_dir, KILL_AT_STEP, killed)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the node's disk is gone


@pytest.mark.slow
def test_restart_restores_from_storage_when_local_checkpoints_are_gone(tmp_path, capfd):
    import ray

    data = write_dataset(str(tmp_path / "shards"), {"train": [200, 200], "validation": [20]},
                         max_seq_length=64)
    try:
        train_on_ray(recipe(data, tmp_path / "straight"), LaunchConfig(workers=2))
        killed: list = []
        killer = threading.Thread(target=kill_worker_and_lose_local_checkpoints,
                                  args=(tmp_path / "faulty", killed))
        killer.start()
        outcome = train_on_ray(
            recipe(data, tmp_path / "faulty"),
            LaunchConfig(workers=2, max_failures=2, storage=str(tmp_path / "storage")),
        )
        killer.join()
    finally:
        ray.shutdown()

    assert killed and killed[0][1] >= KILL_AT_STEP
    output = capfd.readouterr()
    assert "restored step" in output.out + output.err
    assert outcome["step"] == 160
    assert outcome["checkpoint_path"].startswith(str(tmp_path / "storage"))
    straight = load_fp32_state_dict(str(tmp_path / "straight/checkpoints/step_00000160"))
    faulty = load_fp32_state_dict(outcome["checkpoint_path"])
    assert all(torch.equal(straight[name], faulty[name]) for name in straight)
