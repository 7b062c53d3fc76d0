"""Which rank uploads which checkpoint files to Ray Train storage. The end-to-end restore from
storage (a worker killed, the node's local checkpoints gone) is in test_fault_tolerance.py, where
it shares the uninterrupted reference run and the local Ray."""

from bertforge.cluster.launch.persistence import files_of_rank


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
