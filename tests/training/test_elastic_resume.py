"""Resume on another number of workers: the same samples make up every optimizer step."""

import os
import shutil
import socket

import pytest
import torch.multiprocessing as mp

from tests.training.conftest import write_dataset
from tests.training.test_loop import TINY, config
from training.metrics import read_metrics

NO_DROPOUT = {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, cfg_dict: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch

    from training.config import TrainConfig
    from training.loop import train

    torch.set_num_threads(1)
    train(TrainConfig.from_dict(cfg_dict))


def run_on(world_size: int, cfg) -> None:
    mp.spawn(_worker, args=(world_size, _free_port(), cfg.to_dict()), nprocs=world_size)


@pytest.mark.slow
# ZeRO stage 0: at stages 1-3 the optimizer state is sharded per worker and DeepSpeed refuses
# to re-shard it on load (the loop says so before DeepSpeed does).
def test_resume_on_one_worker_continues_a_two_worker_run_with_the_same_batches(tmp_path):
    data = write_dataset(str(tmp_path / "data"), {"train": [70, 60], "validation": [16]},
                         max_seq_length=64)
    run_dir = tmp_path / "run"
    # 16 sequences per step: 2 workers x 8 x 1 accumulation, then 1 worker x 8 x 2.
    cfg = config(data, run_dir, model=NO_DROPOUT, global_batch_size=16, checkpoint_every=3,
                 zero_stage=0, precision="bf16", max_steps=6)
    run_on(2, cfg)
    two_workers = {r["step"]: r for r in read_metrics(str(run_dir))}
    # Crash after step 3: drop what steps 4-6 left behind, then resume on one worker.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    (run_dir / "metrics.jsonl").write_text("".join(
        line for line in (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
        if int(line.split('"step": ')[1].split(",")[0]) <= 3
    ))
    run_on(1, cfg)
    one_worker = {r["step"]: r for r in read_metrics(str(run_dir))}

    assert sorted(one_worker) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        # The same rows in every step: token counts agree exactly (they differ between any
        # two other batches of these random-length rows); losses up to reduction order.
        assert one_worker[step]["tokens"] == two_workers[step]["tokens"]
        assert one_worker[step]["loss"] == pytest.approx(two_workers[step]["loss"], rel=2e-2)
    assert len({two_workers[s]["tokens"] for s in (4, 5, 6)}) == 3


def test_resume_on_another_world_size_under_zero_is_a_clear_error(monkeypatch):
    from training import loop

    monkeypatch.setattr(loop.dist, "get_world_size", lambda: 1)
    cfg = config("d", "r", zero_stage=2)
    with pytest.raises(ValueError, match="saved by 2 workers under ZeRO stage 2.*zero_stage 0"):
        loop.check_world_size_change({"world_size": 2, "zero_stage": 2}, cfg, "ckpt")
    loop.check_world_size_change({"world_size": 1, "zero_stage": 2}, cfg, "ckpt")
    loop.check_world_size_change({"world_size": 2, "zero_stage": 0},
                                 config("d", "r", zero_stage=0), "ckpt")
