"""Resume on another number of workers: the same samples make up every optimizer step, and the
fp32 master weights and Adam moments carry over (ZeRO 1-3 through DeepSpeed's universal
checkpoints)."""

import dataclasses
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from bertforge.training import checkpoint
from bertforge.training.errors import UserInputError
from bertforge.training.metrics import read_metrics
from tests.support.local_cluster import as_local_rank, free_port
from tests.training.conftest import write_dataset
from tests.training.test_loop import TINY, _Payload, config

NO_DROPOUT = {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
STAGES = (0, 1, 2, 3)
# Losses after the resume, relative. Measured on this 2-core CPU (bf16, fp32 accumulation at
# ZeRO >= 1): ZeRO 0-2 within 3.1e-6; ZeRO 3 at most 3.8e-5 (its gradient reduce-scatter rounds
# differently from one rank's accumulation).
# A resume that zeroes the Adam moments moves the step-5 loss by 2.3e-4 at ZeRO 2, so 1e-4
# tells that apart; test_resumed_optimizer_state_* checks the state itself, bitwise.
LOSS_REL_TOLERANCE = 1e-4


def _worker(rank: int, world_size: int, port: int, jobs: list) -> None:
    as_local_rank(rank, world_size, port)
    from bertforge.training.config import TrainConfig
    from bertforge.training.loop import train

    for kind, cfg_dict, *args in jobs:
        cfg = TrainConfig.from_dict(cfg_dict)
        if kind == "train":
            train(cfg)
        else:  # ("state", cfg, checkpoint_path, output_file): what a resume loads
            state = loaded_optimizer_state(cfg, args[0], universal=False)
            if rank == 0:
                torch.save(state, args[1])
    # Leave together: a rank exiting while the other still tears down its connections has
    # been seen to abort ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_on(world_size: int, cfg=None, jobs: list | None = None) -> None:
    """Each job in one process group of `world_size` spawned workers, in order."""
    jobs = jobs if jobs is not None else [("train", cfg.to_dict())]
    mp.spawn(_worker, args=(world_size, free_port(), jobs), nprocs=world_size)


def loaded_optimizer_state(cfg, path: str, *, universal: bool) -> dict[str, torch.Tensor]:
    """Collective: a fresh engine loads `path` as the loop's resume does; its full (unsharded)
    fp32 master weights, Adam moments and step counters."""
    from bertforge.pipelines.contract.manifest import read_manifest
    from bertforge.training.engine import build_engine, ensure_process_group
    from bertforge.training.inputs import resolve_model_config
    from bertforge.training.model import BertForPreTraining
    from bertforge.training.resolved_engine import resolve_engine

    ensure_process_group()
    torch.manual_seed(cfg.seed)
    model = BertForPreTraining(resolve_model_config(
        cfg.model, read_manifest(cfg.data_dir).tokenizer.vocab_size))
    world_size = torch.distributed.get_world_size()
    engine = build_engine(model, resolve_engine(cfg.engine(), world_size),
                          load_universal=universal)
    checkpoint.load(engine, path, universal=universal)
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1-2
        # DeepSpeed links each parameter's view of the Adam moments at the first step; a
        # loaded, not yet stepped engine must link them before they can be read.
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    get = _whole_state_getter(engine, cfg.zero_stage)
    state = {f"{name}/{key}": get(param, key).detach().clone()
             for name, param in engine.module.named_parameters()
             for key in ("fp32", "exp_avg", "exp_avg_sq")}
    torch_optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps it
    steps = {float(s["step"]) for s in torch_optimizer.state.values()}
    state["optimizer_steps"] = torch.tensor(sorted(steps))
    return state


def _whole_state_getter(engine, zero_stage: int):
    """(param, "fp32" | "exp_avg" | "exp_avg_sq") -> the whole fp32 tensor, however sharded."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if zero_stage >= 1:
        return lambda param, key: (safe_get_full_fp32_param(param) if key == "fp32"
                                   else safe_get_full_optimizer_state(param, key))
    # Stage 0: fp32 weights (bf16 runs under torch.autocast), torch's optimizer state whole.
    optimizer = engine.optimizer
    return lambda param, key: param if key == "fp32" else optimizer.state[param][key]


def _drop_after(run_dir, step: int) -> None:
    """A crash after `step`: remove the newer checkpoints and metric lines."""
    for later in checkpoint.committed_steps(str(run_dir)):
        if later > step:
            shutil.rmtree(run_dir / "checkpoints" / checkpoint.tag_for_step(later))
    (run_dir / "metrics.jsonl").write_text("".join(
        line for line in (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
        if int(line.split('"step": ')[1].split(",")[0]) <= step
    ))


def _assert_same_steps_after(resumed: dict, uninterrupted: dict, step: int) -> None:
    assert sorted(resumed) == sorted(uninterrupted)
    later = [s for s in uninterrupted if s > step]
    for s in later:
        # The same rows in every step: token counts agree exactly (they differ between any
        # two other batches of these random-length rows); losses up to reduction order.
        assert resumed[s]["tokens"] == uninterrupted[s]["tokens"], s
        assert resumed[s]["loss"] == pytest.approx(uninterrupted[s]["loss"],
                                                   rel=LOSS_REL_TOLERANCE), s
    assert len({uninterrupted[s]["tokens"] for s in later}) == len(later)


def _copy_of(reference, run_dir):
    """A copy of a reference run to resume from: its config and its step-3 checkpoint."""
    shutil.copytree(reference.run_dir, run_dir)
    step3 = os.path.join(checkpoint.checkpoints_root(str(run_dir)), checkpoint.tag_for_step(3))
    return dataclasses.replace(reference, run_dir=str(run_dir)), step3


def _by_step(run_dir) -> dict:
    return {r["step"]: r for r in read_metrics(str(run_dir))}


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory):
    """Per ZeRO stage, in one 2-worker process group: an uninterrupted run (6 steps, checkpoints
    at 3 and 6), then the optimizer state that a 2-worker resume from step 3 loads (the plain,
    same-world-size path that test_loop proves bitwise)."""
    root = tmp_path_factory.mktemp("elastic")
    data = write_dataset(str(root / "data"), {"train": [70, 60], "validation": [16]},
                         max_seq_length=64)
    runs, jobs = {}, []
    for stage in STAGES:
        # 16 sequences per step: 2 workers x 8 x 1 accumulation, then 1 worker x 8 x 2.
        cfg = config(data, root / f"zero{stage}", model=NO_DROPOUT, global_batch_size=16,
                     checkpoint_every=3, zero_stage=stage, precision="bf16", max_steps=6)
        step3 = os.path.join(checkpoint.checkpoints_root(cfg.run_dir), checkpoint.tag_for_step(3))
        state_file = str(root / f"zero{stage}_state.pt")
        jobs += [("train", cfg.to_dict()), ("state", cfg.to_dict(), step3, state_file)]
        runs[stage] = (cfg, state_file)
    run_on(2, jobs=jobs)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_resume_on_one_worker_continues_a_two_worker_run_with_the_same_batches(
    two_worker_runs, tmp_path, stage
):
    from bertforge.training.loop import train

    reference, _ = two_worker_runs[stage]
    cfg, step3 = _copy_of(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    _drop_after(run_dir, 3)
    universal = checkpoint.universal_path(step3)
    # Leftovers of a conversion killed mid-way: neither may be used, both are cleaned up.
    os.makedirs(universal)
    torch.save({"half": "written"}, os.path.join(universal, "half_written.pt"))
    os.makedirs(os.path.join(os.path.dirname(step3), ".universal-staging-killed"))

    train(cfg)  # one worker, in this process

    _assert_same_steps_after(_by_step(run_dir), _by_step(reference.run_dir), 3)
    names = set(os.listdir(os.path.dirname(step3)))
    assert not any(name.startswith(".universal-staging-") for name in names)
    if stage == 0:  # whole states: loaded as saved, nothing converted
        assert not os.path.exists(os.path.join(universal, checkpoint.COMMIT_MARKER))
    else:
        assert os.path.exists(os.path.join(universal, checkpoint.COMMIT_MARKER))
        assert not os.path.exists(os.path.join(universal, "half_written.pt"))  # replaced
        assert os.path.isdir(os.path.join(universal, "zero", "bert.pooler.dense.weight"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_resumed_optimizer_state_on_one_worker_equals_the_two_worker_one(
    two_worker_runs, tmp_path, stage
):
    reference, state_file = two_worker_runs[stage]
    cfg, step3 = _copy_of(reference, tmp_path / "run")

    one = loaded_optimizer_state(cfg, step3, universal=stage >= 1)
    two = torch.load(state_file, weights_only=True)

    assert one.keys() == two.keys()
    # Three optimizer steps were taken. (DeepSpeed's bf16 wrapper, which stage 0 used before
    # its fp32 weights under torch.autocast, counted one more: a step on zero gradients.)
    assert one["optimizer_steps"].tolist() == [3.0]
    for key, tensor in two.items():  # re-sharding only moves numbers: bitwise equal
        assert one[key].dtype == torch.float32 and torch.equal(one[key], tensor), key
    moments = [t for k, t in one.items() if k.endswith("/exp_avg_sq")]
    assert all(t.abs().sum() > 0 for t in moments)  # real Adam state, not a fresh optimizer
    masters = [t for k, t in one.items() if k.endswith("/fp32")]
    # fp32 masters, not bf16 weights widened: most hold values bf16 cannot represent.
    assert sum(not torch.equal(t, t.bfloat16().float()) for t in masters) > len(masters) // 2


@pytest.mark.slow
def test_resume_on_two_workers_continues_a_one_worker_run_under_zero3(tmp_path):
    from bertforge.training.loop import train

    data = write_dataset(str(tmp_path / "data"), {"train": [70, 60], "validation": [16]},
                         max_seq_length=64)
    common = dict(model=NO_DROPOUT, global_batch_size=16, checkpoint_every=3, zero_stage=3,
                  precision="bf16", max_steps=6)
    train(config(data, tmp_path / "straight", **common))  # one worker: 8 x 2 accumulation
    run_dir = tmp_path / "run"
    shutil.copytree(tmp_path / "straight", run_dir)
    _drop_after(run_dir, 3)
    run_on(2, config(data, run_dir, **common))  # 2 x 8 x 1, from the converted checkpoint
    _assert_same_steps_after(_by_step(run_dir), _by_step(tmp_path / "straight"), 3)


def test_world_size_change_needs_zero_0_in_both_runs_or_zero_1_to_3_in_both(monkeypatch):
    from bertforge.training import loop

    monkeypatch.setattr(loop.dist, "get_world_size", lambda: 1)
    check = loop.check_world_size_change
    assert check({"world_size": 2, "zero_stage": 2}, config("d", "r", zero_stage=3), "c")
    assert not check({"world_size": 2, "zero_stage": 0}, config("d", "r", zero_stage=0), "c")
    assert not check({"world_size": 1, "zero_stage": 2}, config("d", "r", zero_stage=2), "c")
    with pytest.raises(ValueError, match="saved by 2 workers under ZeRO stage 2.*stage 0"):
        check({"world_size": 2, "zero_stage": 2}, config("d", "r", zero_stage=0), "ckpt")
    with pytest.raises(ValueError, match="saved by 2 workers under ZeRO stage 0.*stage 1"):
        check({"world_size": 2, "zero_stage": 0}, config("d", "r", zero_stage=1), "ckpt")
    # On the same number of workers too (DeepSpeed's own errors were a missing
    # bf16_zero_pp_rank file and a NoneType without a copy), and as a user's error: not retried.
    for saved_stage, stage in ((0, 2), (2, 0)):
        with pytest.raises(UserInputError, match=f"ZeRO stage {saved_stage}.*stage {stage}"):
            check({"world_size": 1, "zero_stage": saved_stage},
                  config("d", "r", zero_stage=stage), "ckpt")


def test_safety_check_reaches_the_files_nested_in_a_universal_checkpoint(tmp_path):
    nested = tmp_path / "step_00000003.universal" / "zero" / "bert.pooler.dense.bias"
    nested.mkdir(parents=True)
    torch.save({"param": torch.zeros(2)}, nested / "fp32.pt")
    checkpoint.verify_safe_to_unpickle(str(tmp_path / "step_00000003.universal"))
    torch.save({"param": _Payload()}, nested / "exp_avg.pt")
    with pytest.raises(ValueError, match="exp_avg.pt holds objects outside.*refusing"):
        checkpoint.verify_safe_to_unpickle(str(tmp_path / "step_00000003.universal"))


def test_pruning_drops_the_conversions_of_pruned_checkpoints_and_killed_conversions(tmp_path):
    root = tmp_path / checkpoint.CHECKPOINTS_DIR
    for step in (1, 2, 3):
        tag = checkpoint.tag_for_step(step)
        for name in (tag, tag + checkpoint.UNIVERSAL_SUFFIX):
            (root / name).mkdir(parents=True)
            (root / name / checkpoint.COMMIT_MARKER).write_text("{}")
    (root / ".universal-staging-killed").mkdir()
    checkpoint._prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000002.universal",
                                        "step_00000003", "step_00000003.universal"]
    assert checkpoint.committed_steps(str(tmp_path)) == [2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_weights_of_a_two_worker_checkpoint_are_its_master_weights(two_worker_runs, stage):
    """load_fp32_state_dict (export, evaluation, warm start) reassembles the fp32 masters of
    ZeRO 1-3 shards, ZeRO-1 under bf16 (DeepSpeed's BF16_Optimizer) included. (Stage 0 under
    bf16 reads the module's bf16 weights: its masters sit in an unnamed optimizer list.)"""
    reference, state_file = two_worker_runs[stage]
    step3 = os.path.join(checkpoint.checkpoints_root(reference.run_dir), checkpoint.tag_for_step(3))
    masters = {key[: -len("/fp32")]: t for key, t in torch.load(state_file, weights_only=True)
               .items() if key.endswith("/fp32")}
    state = checkpoint.load_fp32_state_dict(step3)
    for name, tensor in masters.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.slow
def test_with_dropout_a_resume_on_another_world_size_keeps_the_batches_not_the_masks(tmp_path):
    """What the README claims with dropout on (the default): after a resume on another number
    of workers every step holds the same samples, but each rank draws its dropout masks from its
    own generator, so the masks, and from then on the losses, differ as another dropout draw
    would make them (not within 1e-4: that claim is for dropout off, above)."""
    from bertforge.training.loop import train

    data = write_dataset(str(tmp_path / "data"), {"train": [70, 60], "validation": [16]},
                         max_seq_length=64)
    reference = config(data, tmp_path / "two", global_batch_size=16, checkpoint_every=3,
                       zero_stage=0, precision="fp32", max_steps=6)
    run_on(2, reference)
    cfg, _ = _copy_of(reference, tmp_path / "one")
    _drop_after(tmp_path / "one", 3)
    train(cfg)  # one worker, in this process

    resumed, uninterrupted = _by_step(tmp_path / "one"), _by_step(reference.run_dir)
    # Measured here: 2.3e-4, 5.1e-4, 8.3e-4 at steps 4-6 (the 40-step run: 1.9e-4 at the
    # first step after the resume, 6.2e-4 ten steps later).
    relative = {s: abs(resumed[s]["loss"] / uninterrupted[s]["loss"] - 1) for s in (4, 5, 6)}
    assert all(resumed[s]["tokens"] == uninterrupted[s]["tokens"] for s in (4, 5, 6))
    assert all(0 < r < 1e-2 for r in relative.values()), relative
