"""Same seed, same model: two runs of the training loop with one seed give bitwise-identical
losses and weights, on 1 and 2 workers, in fp32 and in bf16, with dropout on (the default).

Each run is the loop as Ray Train's workers run it (DeepSpeed on the CPU, gloo, ZeRO 2), in
spawned process groups. What made two `bertforge demo` runs differ was upstream of training (the
WordPiece trainer, tests/pipelines/test_vocab.py); this holds the rest of the chain to it.
"""

import pytest
import torch

from bertforge.training import checkpoint
from tests.training.conftest import write_dataset
from tests.training.test_elastic_resume import run_on
from tests.training.test_loop import config, losses


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [70, 60], "validation": [16]}, max_seq_length=64)


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    model, _ = checkpoint.load_model(checkpoint.latest_checkpoint(str(run_dir)))
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_two_runs_with_one_seed_train_the_same_model(dataset, tmp_path, world_size):
    runs = {}
    jobs = []
    for precision in ("fp32", "bf16"):
        for attempt in ("first", "second"):
            cfg = config(dataset, tmp_path / f"{precision}-{attempt}", precision=precision,
                         global_batch_size=16, max_steps=4, seed=7)
            runs[precision, attempt] = cfg.run_dir
            jobs.append(("train", cfg.to_dict()))
    run_on(world_size, jobs=jobs)

    for precision in ("fp32", "bf16"):
        first, second = runs[precision, "first"], runs[precision, "second"]
        assert losses(first) == losses(second) and len(losses(first)) == 4
        a, b = final_weights(first), final_weights(second)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[name], b[name]) for name in a), precision
    # The two precisions are two models: the check above compares like with like.
    assert losses(runs["fp32", "first"]) != losses(runs["bf16", "first"])
