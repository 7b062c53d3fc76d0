"""The loop through the real DeepSpeed engine on the CPU (gloo), in this process."""

import json
import os
import pickle
import shutil

import pytest
import torch

from bertforge.training import checkpoint, loop
from bertforge.training.config import TrainConfig
from bertforge.training.errors import UserInputError
from bertforge.training.eval_options import EvalOptions
from bertforge.training.evaluate import evaluate_checkpoint
from bertforge.training.export import export_checkpoint
from bertforge.training.loop import moved_path, train
from bertforge.training.metrics import read_metrics
from tests.training.conftest import write_dataset

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [70, 60], "validation": [40]}, max_seq_length=64)


def config(data_dir, run_dir, **overrides):
    values = dict(data_dir=data_dir, run_dir=str(run_dir), model=TINY, max_steps=6,
                  micro_batch_size=8, warmup_steps=2, learning_rate=1e-3, log_every=1,
                  zero_stage=2, precision="bf16", keep_checkpoints=5)
    values.update(overrides)
    return TrainConfig(**values)


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}


# ZeRO-2 (DeepSpeed's bf16 weights), and the fast path with the opt-in FP8 GEMMs, whose
# scales are taken afresh at every step and so need no state of their own in a checkpoint.
@pytest.mark.parametrize("engine", [{}, {"zero_stage": 0, "fp8": True}], ids=["zero2", "fp8"])
def test_resumed_run_reproduces_uninterrupted_losses_and_weights_bitwise(dataset, tmp_path,
                                                                          engine):
    straight = train(config(dataset, tmp_path / "straight", **engine))
    # The same run, checkpointing every 3 steps; then "crash" after step 3 by removing
    # everything the steps after it wrote, and run the same command again.
    interrupted = tmp_path / "interrupted"
    train(config(dataset, interrupted, checkpoint_every=3, **engine))
    shutil.rmtree(interrupted / "checkpoints" / "step_00000006")
    with open(interrupted / "metrics.jsonl") as f:
        kept = [line for line in f if '"step": 4' not in line and '"step": 5' not in line
                and '"step": 6' not in line]
    (interrupted / "metrics.jsonl").write_text("".join(kept))
    resumed = train(config(dataset, interrupted, checkpoint_every=3, **engine))

    assert resumed.global_step == straight.global_step == 6
    assert losses(interrupted) == losses(tmp_path / "straight")  # every step, bitwise
    a = checkpoint.load_fp32_state_dict(straight.checkpoint_path)
    b = checkpoint.load_fp32_state_dict(resumed.checkpoint_path)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_after_a_crash_and_a_resume_every_step_is_in_the_metrics_once(dataset, tmp_path):
    """The steps a crashed run logged after its last checkpoint are trained again on resume;
    metrics.jsonl (and the curves drawn from it) then holds each step once: the resumed
    run's numbers."""
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, checkpoint_every=3))
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")  # the crash: 4-6 logged, not saved
    logged_before = [r["step"] for r in read_metrics(str(run_dir))]
    assert logged_before == [1, 2, 3, 4, 5, 6]
    train(config(dataset, run_dir, checkpoint_every=3))
    assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2, 3, 4, 5, 6]


def test_a_run_without_a_step_cadence_saves_by_time_at_its_log_lines(dataset, tmp_path):
    """A plain `train` (no --checkpoint-every) saved only at its end, so a failure hours in
    restarted it from step 0; now it saves once --checkpoint-minutes have passed, looked at
    on log lines (a tiny interval: every log line, the first step's included)."""
    train(config(dataset, tmp_path / "timed", log_every=2, checkpoint_minutes=1e-9))
    assert checkpoint.committed_steps(str(tmp_path / "timed")) == [1, 2, 4, 6]
    train(config(dataset, tmp_path / "untimed", log_every=2, checkpoint_minutes=0))
    assert checkpoint.committed_steps(str(tmp_path / "untimed")) == [6]


def test_a_save_replaces_what_an_earlier_save_of_its_step_left(dataset, tmp_path):
    """A 2-worker save killed before its marker left rank 1's files in step_N; the resume on
    1 worker saved step N into that folder and committed it with them, and an older
    step_N.universal was loaded for it: a later resume on 2 workers read other weights."""
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, max_steps=3))
    step_6 = run_dir / "checkpoints" / "step_00000006"
    step_6.mkdir()
    stale = step_6 / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    stale.write_bytes(b"rank 1 of a killed save")
    old_conversion = run_dir / "checkpoints" / "step_00000006.universal"
    old_conversion.mkdir()
    (old_conversion / checkpoint.COMMIT_MARKER).write_text('{"time": 1.0}')
    result = train(config(dataset, run_dir, max_steps=6))
    assert result.checkpoint_path == str(step_6)
    assert checkpoint.committed_steps(str(run_dir))[-1] == 6 and not stale.exists()
    assert not old_conversion.exists()


def test_a_resume_missing_a_ranks_random_state_is_refused(dataset, tmp_path):
    """Without rng_rank_00000.pt the load passed over it (as for a rank more than saved) and
    the resumed run drew other masks and dropout: no longer the uninterrupted run, no word."""
    run_dir = tmp_path / "run"
    saved = train(config(dataset, run_dir, max_steps=3)).checkpoint_path
    os.remove(os.path.join(saved, "rng_rank_00000.pt"))
    with pytest.raises(UserInputError, match=f"{saved} lacks rng_rank_00000.pt, the random "
                                             "state of rank 0, which saved it"):
        train(config(dataset, run_dir, max_steps=6))


def test_a_conversion_older_than_its_checkpoints_commit_is_not_used(tmp_path):
    saved, converted = tmp_path / "step_00000006", tmp_path / "step_00000006.universal"
    for folder, when in ((saved, 200.0), (converted, 100.0)):
        folder.mkdir()
        (folder / checkpoint.COMMIT_MARKER).write_text(json.dumps({"time": when}))
    assert not checkpoint._converted_since_committed(str(converted), str(saved))
    (converted / checkpoint.COMMIT_MARKER).write_text(json.dumps({"time": 300.0}))
    assert checkpoint._converted_since_committed(str(converted), str(saved))


def test_the_save_clock_counts_from_the_last_save(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(loop.time, "monotonic", lambda: now[0])
    clock = loop._SaveClock(minutes=2)
    now[0] += 119
    assert not clock.due()
    now[0] += 1
    assert clock.due()
    clock.saved()
    assert not clock.due()
    now[0] += 120
    assert clock.due()
    assert not loop._SaveClock(minutes=0).due()  # 0: never by time


def test_an_attempt_stopped_before_its_first_save_leaves_no_steps_twice(dataset, tmp_path):
    """Stopped (SIGTERM, a failure) before its first checkpoint, a run had logged steps 1-4;
    the same command started afresh and appended its own steps 1-6 after them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "loss": 9.0}) + "\n" for step in range(1, 5)))
    train(config(dataset, run_dir))
    assert [r["step"] for r in read_metrics(str(run_dir))] == [1, 2, 3, 4, 5, 6]
    assert 9.0 not in losses(run_dir).values()


def test_rerun_of_a_finished_run_trains_no_further(dataset, tmp_path):
    first = train(config(dataset, tmp_path / "run"))
    again = train(config(dataset, tmp_path / "run"))
    assert again.global_step == 6 and again.loss_first is None
    assert again.checkpoint_path == first.checkpoint_path


def test_uncommitted_checkpoint_is_ignored_and_old_ones_pruned(dataset, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, checkpoint_every=2, keep_checkpoints=2))
    assert checkpoint.committed_steps(str(run_dir)) == [4, 6]
    # ZeRO 2 (the module's config): DeepSpeed's zero_to_fp32.py and zero_to_torch.py, copied
    # beside the step folders at every save, are not left there (they fail on these
    # checkpoints as they stand; `bertforge export` is the way out).
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_00000004", "step_00000006"]
    os.remove(run_dir / "checkpoints" / "step_00000006" / checkpoint.COMMIT_MARKER)
    assert checkpoint.latest_checkpoint(str(run_dir)).endswith("step_00000004")
    # The resume says that the newer step folder was a save cut short (a kill mid-save).
    capsys.readouterr()
    train(config(dataset, run_dir, checkpoint_every=2, keep_checkpoints=2))
    assert (f"[train] resumed from {run_dir / 'checkpoints' / 'step_00000004'} at step 4 (the "
            "save of step 6 was cut short: not a checkpoint, its files are cleared)\n"
            ) in capsys.readouterr().out
    assert checkpoint.committed_steps(str(run_dir)) == [4, 6]


def test_training_learns_and_checkpoint_evaluates_and_exports(dataset, tmp_path):
    run = train(config(dataset, tmp_path / "run", max_steps=40, learning_rate=3e-3,
                       zero_stage=1, log_every=5))
    history = losses(tmp_path / "run")
    assert history[40] < history[1]
    result = evaluate_checkpoint(run.checkpoint_path, dataset, EvalOptions(batch_size=16))
    assert result.num_sequences == 40
    assert 0.0 <= result.mlm_accuracy <= 1.0 and 0.0 <= result.nsp_accuracy <= 1.0
    hf_dir = export_checkpoint(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors"))


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_resume_with_more_steps_trains_on_the_new_schedule_and_says_so(dataset, tmp_path,
                                                                          capsys, zero_stage):
    """Extending a finished run (6 steps, warm-up 2, lr 1e-3) to 7: the schedule is this
    run's from the first resumed step, 2e-4 = 1e-3 x (7 - 6) / (7 - 2), where the load had
    put back the old plan's 0 (step 7 changed no weight, and no word was said)."""
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, zero_stage=zero_stage))
    train(config(dataset, run_dir, zero_stage=zero_stage))  # the same plan: nothing to say
    out = capsys.readouterr().out
    assert "learning-rate schedule" not in out and "a step is" not in out
    train(config(dataset, run_dir, zero_stage=zero_stage, max_steps=7))
    out = capsys.readouterr().out
    assert ("[train] the learning-rate schedule follows this run's settings: max_steps 7 (was "
            "6); step 7 trains at lr 0.0002 where the checkpoint's plan had 0") in out, out
    before = checkpoint.load_fp32_state_dict(str(run_dir / "checkpoints" / "step_00000006"))
    after = checkpoint.load_fp32_state_dict(str(run_dir / "checkpoints" / "step_00000007"))
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_a_resume_with_another_batch_says_a_step_is_now_another_size(dataset, tmp_path,
                                                                      capsys):
    """Resumed with another --batch-size (or --workers), a step changed size without a word."""
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, zero_stage=0, max_steps=2))
    capsys.readouterr()
    train(config(dataset, run_dir, zero_stage=0, max_steps=3, micro_batch_size=4))
    assert ("[train] a step is 4 sequences from here (the checkpoint's run's were 8): "
            "another --batch-size, --workers, --global-batch-size or --recipe than the run's"
            ) in capsys.readouterr().out


def test_a_resume_whose_batch_cannot_continue_the_position_is_a_user_error(dataset, tmp_path):
    """20 samples in, a step of 8 cannot continue: the loader's ValueError was retried by Ray
    Train on every attempt (four tracebacks a worker); a user error ends the run at once."""
    from bertforge.training.errors import UserInputError

    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, zero_stage=0, max_steps=5, micro_batch_size=4))
    with pytest.raises(UserInputError, match=r"step_00000005: cannot resume after 20 samples "
                                             r"of epoch 0 with a global batch of 8"):
        train(config(dataset, run_dir, zero_stage=0, max_steps=8, micro_batch_size=8))


def test_vocabulary_mismatch_on_resume_is_refused(dataset, tmp_path):
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, max_steps=2, warmup_steps=1))
    other = write_dataset(str(tmp_path / "other"), {"train": [40], "validation": [8]},
                          max_seq_length=64, seed=3)
    with open(os.path.join(other, "vocab.txt"), "a") as f:
        f.write("extra\n")
    from bertforge.pipelines.contract import manifest as manifest_lib

    manifest = manifest_lib.read_manifest(other)
    manifest.tokenizer.vocab_sha256 = manifest_lib.sha256_file(os.path.join(other, "vocab.txt"))
    manifest.tokenizer.vocab_size += 1
    manifest_lib.write_manifest(other, manifest)
    with pytest.raises(ValueError, match="another vocabulary"):
        train(config(other, run_dir, max_steps=4, warmup_steps=1))


class _Payload:
    """Stands for an object a tampered checkpoint smuggles in: unpickling it runs code."""

    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_checkpoint_with_arbitrary_pickled_objects_is_refused(dataset, tmp_path):
    run = train(config(dataset, tmp_path / "run", max_steps=2, warmup_steps=1))
    torch.save({"payload": _Payload()}, os.path.join(run.checkpoint_path, "rng_rank_00000.pt"))
    with pytest.raises(ValueError, match="refusing to load it"):
        checkpoint.load_fp32_state_dict(run.checkpoint_path)
    with pytest.raises(ValueError, match="refusing to load it"):
        train(config(dataset, tmp_path / "run", max_steps=4, warmup_steps=1))
    # A raw (or legacy torch) pickle: one line, before anything is unpickled or memory-mapped.
    with open(os.path.join(run.checkpoint_path, "rng_rank_00000.pt"), "wb") as f:
        pickle.dump(_Payload(), f)
    with pytest.raises(ValueError, match="not a torch zip checkpoint") as caught:
        checkpoint.load_fp32_state_dict(run.checkpoint_path)
    assert "\n" not in str(caught.value)


def test_a_new_run_on_a_used_run_directory_loses_no_checkpoint(dataset, tmp_path, capsys):
    """Issue 25: a run of 8 steps, then `--resume never` on the same directory for 4 steps,
    checkpointing every step. The old run's checkpoints once pruned the new run's as it wrote
    them (they had higher step numbers) and export gave the old weights."""
    run_dir = tmp_path / "run"
    old = train(config(dataset, run_dir, max_steps=8, checkpoint_every=4, keep_checkpoints=2))
    old_weights = checkpoint.load_fp32_state_dict(old.checkpoint_path)
    capsys.readouterr()
    new = train(config(dataset, run_dir, resume=False, max_steps=4, checkpoint_every=1,
                       keep_checkpoints=2))
    out = capsys.readouterr().out

    # The old run is kept aside, whole and named: its checkpoints, metrics and config.
    (moved,) = os.listdir(run_dir / checkpoint.PREVIOUS_DIR)
    aside = run_dir / checkpoint.PREVIOUS_DIR / moved
    size = checkpoint.shown_bytes(checkpoint.folder_bytes(str(aside)))
    assert moved == old.run_id and f"kept in {aside} ({size};" in out and "steps 4-8" in out
    assert checkpoint.committed_steps(str(aside)) == [4, 8]
    kept = checkpoint.load_fp32_state_dict(checkpoint.latest_checkpoint(str(aside)))
    assert all(torch.equal(kept[name], old_weights[name]) for name in old_weights)
    assert max(losses(aside)) == 8 and (aside / "config.json").exists()
    # The new run's checkpoints are intact and are what the run directory now holds.
    assert checkpoint.committed_steps(str(run_dir)) == [3, 4]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    assert new.global_step == 4 and new.checkpoint_path.endswith("step_00000004")
    assert new.run_id and new.run_id != old.run_id
    assert f"[train] run {new.run_id}: step 4, weights in {new.checkpoint_path}" in out
    assert checkpoint.read_metadata(new.checkpoint_path)["run_id"] == new.run_id
    assert checkpoint.latest_checkpoint(str(run_dir)) == new.checkpoint_path
    hf_dir = export_checkpoint(str(run_dir), str(tmp_path / "hf"))
    with open(os.path.join(hf_dir, "config.json")) as f:
        source = json.load(f)["bertforge_source"]
    assert source["run_id"] == new.run_id and source["global_step"] == 4
    # `--resume auto` afterwards continues the new run, under its id.
    again = train(config(dataset, run_dir, max_steps=5, checkpoint_every=1, keep_checkpoints=2))
    assert again.run_id == new.run_id and checkpoint.committed_steps(str(run_dir)) == [4, 5]
    # A new run warm-started from the run directory's own run (`--init-from RUN --resume
    # never`): its weights are what the move puts under previous/, and config.json names
    # that, not RUN, whose newest checkpoint is now the new run's.
    train(config(dataset, run_dir, resume=False, init_from=str(run_dir), max_steps=1,
                 warmup_steps=0))
    run_config = json.loads((run_dir / "config.json").read_text())
    started_from = run_config["train"]["init_from"]
    assert started_from == str(run_dir / checkpoint.PREVIOUS_DIR / new.run_id)
    assert checkpoint.latest_checkpoint(started_from).endswith("step_00000005")
    # Which checkpoint gave the weights, recorded where they go (config.json and the
    # checkpoints): init_from named a run, whose newest checkpoint moves on.
    warm_start = {"init_from": started_from, "global_step": 5, "run_id": new.run_id,
                  "checkpoint": checkpoint.latest_checkpoint(started_from)}
    assert run_config["warm_start"] == warm_start
    warmed = checkpoint.latest_checkpoint(str(run_dir))
    assert checkpoint.read_metadata(warmed)["warm_start"] == warm_start
    # A resume keeps it; a run from scratch records none.
    train(config(dataset, run_dir, max_steps=2, warmup_steps=0))
    assert checkpoint.read_metadata(checkpoint.latest_checkpoint(str(run_dir)))[
        "warm_start"] == warm_start
    assert json.loads((run_dir / "config.json").read_text())["warm_start"] == warm_start
    from_scratch = checkpoint.read_metadata(checkpoint.latest_checkpoint(started_from))
    assert "warm_start" in from_scratch and from_scratch["warm_start"] is None
    elsewhere = str(aside / "checkpoints")  # not moved: named as it was
    assert moved_path(elsewhere, str(run_dir), started_from) == elsewhere


def test_validation_of_a_split_smaller_than_the_micro_batch(dataset, tmp_path):
    """A device's micro-batch (512 on an H200) may exceed a small validation split: the
    evaluation then runs in batches the split fills (40 rows here, against 64 a micro-batch),
    where the validation loader refused to start (seen through Ray Train on an H200)."""
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, micro_batch_size=64, max_steps=2, eval_every=1,
                 eval_batches=0, zero_stage=0, precision="fp32"))
    evaluations = [r for r in read_metrics(str(run_dir)) if "eval_mlm_accuracy" in r]
    assert [r["step"] for r in evaluations] == [1, 2]
    assert all(0 <= r["eval_mlm_accuracy"] <= 1 for r in evaluations)


def test_eval_masks_the_split_as_the_run_did_by_default(dataset, tmp_path):
    """`bertforge eval` of a run and the run's own numbers (its validation, the demo's eval)
    draw the same masks: the checkpoint's training seed, recorded in bertforge.json."""
    run = train(config(dataset, tmp_path / "run", max_steps=2, seed=7))
    assert checkpoint.read_metadata(run.checkpoint_path)["seed"] == 7
    default = evaluate_checkpoint(run.checkpoint_path, dataset, EvalOptions(batch_size=16))
    assert default == evaluate_checkpoint(run.checkpoint_path, dataset,
                                          EvalOptions(batch_size=16, seed=7))
    other = evaluate_checkpoint(run.checkpoint_path, dataset, EvalOptions(batch_size=16, seed=0))
    assert other.mlm_loss != default.mlm_loss


def test_eval_of_a_run_with_its_own_masking_gives_its_validation_numbers(dataset, tmp_path):
    """A run that masks 30 % by whole words, at most 15 a row: eval of its checkpoint masks
    the same way (recorded in bertforge.json), so its numbers are the run's own validation's
    (the whole split), not those of Google's default masking. Its 40 rows are 2 batches of 16
    and a partial one of 8, which the run's validation left out (eval scores every row): the
    same checkpoint's numbers were those of 32 rows in metrics.jsonl and of 40 in eval."""
    run_dir = tmp_path / "run"
    run = train(config(dataset, run_dir, max_steps=2, eval_every=2, eval_batches=0,
                       zero_stage=0, precision="fp32", mask_prob=0.3, max_predictions=15,
                       whole_word_masking=True, micro_batch_size=16))
    [logged] = [r for r in read_metrics(str(run_dir)) if "eval_mlm_accuracy" in r]
    result = evaluate_checkpoint(run.checkpoint_path, dataset, EvalOptions(batch_size=8))
    assert logged["eval_sequences"] == result.num_sequences == 40  # each says what it counted
    assert result.mlm_loss == pytest.approx(logged["eval_mlm_loss"], rel=1e-5)
    assert result.mlm_accuracy == pytest.approx(logged["eval_mlm_accuracy"], rel=1e-6)


def test_a_rank_the_last_partial_batch_leaves_no_row_scores_a_blank_one(dataset):
    """33 validation rows on 2 ranks in batches of 8: the last global batch holds one row,
    rank 1 none. It runs the forward on a blank row (every rank joins every ZeRO-3 gather),
    which adds nothing to the counts and no NaN to the losses."""
    from bertforge.training.data import PretrainingLoader
    from bertforge.training.evaluate import evaluate
    from bertforge.training.inputs import resolve_model_config
    from bertforge.training.model import BertForPreTraining

    data = write_dataset(os.path.join(os.path.dirname(dataset), "odd"), {"validation": [33]})
    model = BertForPreTraining(resolve_model_config(TINY, 264))
    totals = []
    for rank in (0, 1):
        loader = PretrainingLoader(data, "validation", batch_size=8, seed=1, rank=rank,
                                   world_size=2, drop_last=False, prefetch=0)
        batches = list(loop.every_rank_a_row(loader))
        assert len(batches) == 3 and [len(b["next_sentence_label"]) for b in batches][-1] == 1
        totals.append(evaluate(model, iter(batches), baseline_token_id=5))
    assert totals[0].num_sequences + totals[1].num_sequences == 33
    assert totals[1].num_sequences == 16  # the blank row counted nothing
    assert all(torch.isfinite(torch.tensor([t.mlm_loss, t.nsp_loss])).all() for t in totals)


def test_an_eval_cadence_past_the_last_step_is_said_not_silent(dataset, tmp_path, capsys):
    """`--eval-every 5 --steps 2` (a recipe's cadence over a shortened run) evaluates nothing;
    the console says so instead of leaving the user to wonder where the eval lines went."""
    train(config(dataset, tmp_path / "run", max_steps=2, eval_every=5, zero_stage=0,
                 precision="fp32"))
    assert ("[train] no validation pass in this run: --eval-every 5 is past its last step (2)"
            in capsys.readouterr().out)
    assert not any("eval_mlm_loss" in r for r in read_metrics(str(tmp_path / "run")))
    train(config(dataset, tmp_path / "evaluated", max_steps=2, eval_every=2, zero_stage=0,
                 precision="fp32"))
    assert "no validation pass" not in capsys.readouterr().out


def test_a_dataset_in_object_storage_trains_from_a_copy_on_the_node(
        dataset, tmp_path, monkeypatch):
    """`--data gs://...` (a Dataflow job's output) passed the driver's pre-flight and then
    failed in every worker ("not a prepared dataset"): the workers read a local directory.
    Here a local folder stands in for the bucket, reached through pyarrow as gs:// would be."""
    import tempfile
    import types

    import pyarrow.fs as pafs

    from bertforge.pipelines.contract import manifest as manifest_lib
    from bertforge.training.data import download

    bucket = pafs.SubTreeFileSystem(os.path.dirname(dataset), pafs.LocalFileSystem())

    def from_uri(uri):
        assert uri.startswith("gs://bucket/"), uri
        return bucket, uri.removeprefix("gs://bucket/")

    # pyarrow's types cannot be patched: the module's name for pyarrow.fs, with gs:// routed.
    shim = types.SimpleNamespace(**{name: getattr(pafs, name) for name in dir(pafs)})
    shim.FileSystem = types.SimpleNamespace(from_uri=from_uri)
    monkeypatch.setattr(download, "pafs", shim)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    uri = f"gs://bucket/{os.path.basename(dataset)}"
    result = train(config(uri, tmp_path / "run", max_steps=2, eval_every=2, eval_batches=1))
    assert result.global_step == 2
    copies = os.listdir(tmp_path / "node-tmp" / "bertforge-datasets")
    assert len(copies) == 1  # both splits in one copy, named by the manifest's digest
    copy = str(tmp_path / "node-tmp" / "bertforge-datasets" / copies[0])
    manifest = manifest_lib.read_manifest(copy)
    assert all(os.path.isfile(os.path.join(copy, entry.path))
               for split in ("train", "validation") for entry in manifest.splits[split].shards)
    assert checkpoint.read_metadata(result.checkpoint_path)["data_dir"] == uri
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]["data_dir"]
    assert recorded == uri


def test_the_run_config_records_the_accumulation_used(dataset, tmp_path):
    """With --global-batch-size the accumulation follows from the workers; config.json said
    the --grad-accum given beside it (ignored), or 1."""
    train(config(dataset, tmp_path / "run", max_steps=1, warmup_steps=0, zero_stage=0,
                 precision="fp32", global_batch_size=16, gradient_accumulation_steps=5))
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert (recorded["gradient_accumulation_steps"], recorded["micro_batch_size"]) == (2, 8)


def test_a_resume_on_data_of_the_other_casing_is_refused_by_the_loop(dataset, tmp_path):
    """Under Ray a checkpoint restored from storage reaches the loop after the driver's
    pre-flight: the loop checks the casing itself."""
    from bertforge.training.errors import UserInputError

    train(config(dataset, tmp_path / "run", max_steps=2))
    cased = str(tmp_path / "cased")
    shutil.copytree(dataset, cased)
    manifest = json.loads(open(os.path.join(cased, "manifest.json")).read())
    manifest["tokenizer"]["lower_case"] = False
    with open(os.path.join(cased, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(UserInputError, match="was trained on lower-cased text and .*cased is "
                                             "cased"):
        train(config(cased, tmp_path / "run", max_steps=3))


def test_a_diverged_run_stops_and_saves_no_nan_weights(dataset, tmp_path):
    """A loss that is no longer a number (a learning rate far too high here; `--adam-eps 0`
    before it was refused) trained on, saved and exported NaN weights, and the run exited 0.
    Now it stops at the first log line or checkpoint that sees it, as an error no retry
    mends, and its newest checkpoint is the last one with numbers."""
    from bertforge.training.errors import DivergedError

    run_dir = tmp_path / "run"
    # Log lines every 5 steps, checkpoints every step: the checkpoint of step 2 looks first.
    with pytest.raises(DivergedError, match=r"the loss is nan by step 2, [0-9.]+ at the log "
                                            r"line before: training diverged; the newest "
                                            r"checkpoint, .*step_00000001, holds the weights"):
        train(config(dataset, run_dir, learning_rate=1e6, warmup_steps=0, log_every=5,
                     checkpoint_every=1, precision="fp32", zero_stage=0))
    assert os.path.basename(checkpoint.latest_checkpoint(str(run_dir))) == "step_00000001"
    # Every log line: stopped at the line of step 2, which is in the metrics.
    with pytest.raises(DivergedError, match="the loss is nan by step 2"):
        train(config(dataset, tmp_path / "logged", learning_rate=1e6, warmup_steps=0,
                     precision="fp32", zero_stage=0))
    assert [r["step"] for r in read_metrics(str(tmp_path / "logged"))] == [1, 2]


def test_a_resume_that_names_no_setting_keeps_the_runs_own(dataset, tmp_path, capsys):
    """`bertforge train --data D --run-dir R` over a 6-step run of batch 8 that kept 5
    checkpoints took the defaults: it trained on to 1,000 steps of batch 32, and pruned the
    run's checkpoints down to the default 2."""
    from bertforge.cluster.cli import build_parser, train_config_from_args

    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, checkpoint_every=2, precision="fp32"))

    def resumed(*flags):
        args = build_parser().parse_args(["train", "--data", dataset, "--run-dir",
                                          str(run_dir), *flags])
        return train_config_from_args(args)

    cfg = resumed()
    assert (cfg.max_steps, cfg.micro_batch_size, cfg.keep_checkpoints, cfg.checkpoint_every,
            cfg.learning_rate, cfg.zero_stage, cfg.precision) == (6, 8, 5, 2, 1e-3, 2, "fp32")
    assert cfg.model["hidden_size"] == 32  # the run's model (warm_start.continued_model)
    said = capsys.readouterr().out
    assert f"[train] resuming {run_dir} with its own settings where this command gives none: " \
           in said and "--max-steps 6" in said and "--micro-batch-size 8" in said
    # And its workers, where a step's batch is workers x micro-batch: the default 2 trained a
    # 1-worker run on at twice its batch.
    from bertforge.cluster.cli import _train_configs

    def launched(*flags):
        return _train_configs(build_parser().parse_args(
            ["train", "--data", dataset, "--run-dir", str(run_dir), *flags]))[1]

    assert launched().workers == 1
    assert f"[train] resuming {run_dir} on its own --workers 1" in capsys.readouterr().out
    assert launched("--workers", "2").workers == 2
    assert launched("--global-batch-size", "16").workers == 2  # the batch is fixed anyway
    assert launched("--resume", "never").workers == 2
    again = train(cfg)  # the same run, finished: nothing more to train, nothing pruned
    assert again.global_step == 6 and again.loss_first is None
    assert checkpoint.committed_steps(str(run_dir)) == [2, 4, 6]
    # A flag that does not go with a kept setting names where that setting came from: the
    # run's ZeRO 2 was "got 2" of a stage the command never named.
    with pytest.raises(ValueError, match=r"--optimizer 'lamb' needs zero_stage 0, got 2: .* "
                       r"\(this resume keeps the run's own .*--zero-stage 2.*, where the "
                       r"command gives none\)$"):
        resumed("--optimizer", "lamb")
    capsys.readouterr()
    longer = resumed("--steps", "8", "--lr", "5e-4")  # what a command gives wins
    assert (longer.max_steps, longer.learning_rate, longer.micro_batch_size) == (8, 5e-4, 8)
    # and is said beside what the run had (a --mask-prob given by habit changed it silently);
    # what the command gives as the run had it is not.
    said = capsys.readouterr().out
    assert f"[train] resuming {run_dir} with this command's --max-steps 8 (the run's: 6), " \
           "--learning-rate 0.0005 (the run's: 0.001)\n" in said, said
    resumed("--micro-batch-size", "8", "--no-packing")
    assert "with this command's" not in capsys.readouterr().out
    resumed("--packing")
    assert "with this command's --packing (the run's: --no-packing)" in capsys.readouterr().out
    fresh = resumed("--resume", "never")  # a new run: the defaults
    assert (fresh.max_steps, fresh.micro_batch_size) == (1000, 32)
    assert longer.warmup_steps == 2  # given to the run, kept
    # What followed the run's length follows a new one: a run of 100,000 steps (warm-up
    # 10,000) ended at its checkpoint's step was refused: "--warmup-steps must be in [0,
    # max_steps], got 10000".
    metadata_path = os.path.join(checkpoint.latest_checkpoint(str(run_dir)),
                                 checkpoint.METADATA_NAME)
    with open(metadata_path) as f:
        metadata = json.load(f)
    metadata["train_config"].update(max_steps=100_000, warmup_steps=10_000, log_every=50)
    # Saved before checkpoints said which settings followed the length: equal to what it
    # derives counts as derived.
    del metadata["train_config"]["derived_from_max_steps"]
    with open(metadata_path, "w") as f:
        json.dump(metadata, f)
    ended = resumed("--max-steps", "6")
    assert (ended.warmup_steps, ended.log_every, ended.micro_batch_size) == (0, 1, 8)


def test_a_longer_resume_keeps_a_warm_up_given_and_derives_one_left_to_the_length(dataset,
                                                                                  tmp_path):
    """`--steps 10 --warmup-steps 1` (what 10 steps derive anyway), resumed with `--steps 20`,
    trained on with a warm-up of 2: a setting given was taken for a derived one, against "a
    resume keeps the run's own settings for every flag its command does not give". A warm-up
    left to the length follows the new one."""
    from bertforge.cluster.cli import build_parser, train_config_from_args

    def resumed(run_dir, *flags):
        return train_config_from_args(build_parser().parse_args(
            ["train", "--data", dataset, "--run-dir", str(run_dir), *flags]))

    warmups = {}
    for name, warmup in (("given", 1), ("left", None)):
        train(config(dataset, tmp_path / name, max_steps=10, warmup_steps=warmup, zero_stage=0,
                     precision="fp32"))
        warmups[name] = resumed(tmp_path / name, "--steps", "20").warmup_steps
        same_length = resumed(tmp_path / name)
        assert same_length.warmup_steps == 1  # the same plan
        # And it stays derived (or given) in the resumed run's own record: a derived warm-up
        # continued as a setting counted as given there, and a later --steps kept it.
        assert ("warmup_steps" in same_length.derived) == (warmup is None)
    assert warmups == {"given": 1, "left": 2}
