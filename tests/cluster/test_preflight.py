"""Pre-flight: user errors are found by the driver in seconds, before Ray starts, in one line;
inside a Ray run, a user error ends it after one attempt (only crashes are retried)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.launch.ray_train import warn_of_an_unfinished_source
from bertforge.pipelines.contract import manifest as manifest_lib
from bertforge.training import checkpoint, recipes
from bertforge.training.config import TrainConfig
from bertforge.training.inputs import check_phase2_length
from bertforge.training.loop import train
from tests.support.refusals import refused
from tests.training.conftest import write_dataset

TINY = {"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(str(tmp_path / "data"), {"train": [40, 30], "validation": [16]})


def shard(data_dir: str, index: int = 1) -> str:
    entry = manifest_lib.read_manifest(data_dir).splits["train"].shards[index]
    return os.path.join(data_dir, entry.path)


def test_dataset_errors_are_refused_before_ray(dataset, tmp_path, capsys):
    run = ["--run-dir", str(tmp_path / "run"), "--workers", "1", "--max-failures", "3"]
    missing = str(tmp_path / "nope")
    refused(["train", "--data", missing, *run], capsys, f"dataset {missing} does not exist")
    refused(["train", "--data", str(tmp_path), *run], capsys, "manifest.json not found")

    path = shard(dataset)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    refused(["train", "--data", dataset, *run], capsys, f"shard {path} is corrupt or truncated")
    os.remove(path)
    refused(["train", "--data", dataset, *run], capsys, f"shard {path} is missing")
    os.symlink(str(tmp_path / "moved.arrow"), path)  # a shard moved away, its link left
    refused(["train", "--data", dataset, *run], capsys,
            f"shard {path} is a symbolic link to a missing file ({tmp_path / 'moved.arrow'})")
    os.remove(path)

    manifest_path = os.path.join(dataset, manifest_lib.MANIFEST_NAME)
    with open(manifest_path, "a", encoding="utf-8") as f:
        f.write("}{")  # a manifest cut or appended to by hand
    refused(["train", "--data", dataset, *run], capsys,
            f"{manifest_path} is not a valid bertforge manifest")


def test_vocabulary_with_another_sha_is_refused(dataset, tmp_path, capsys):
    vocab = os.path.join(dataset, manifest_lib.VOCAB_NAME)
    with open(vocab, "a", encoding="utf-8") as f:
        f.write("extra\n")
    refused(["train", "--data", dataset, "--run-dir", str(tmp_path / "run")], capsys,
            f"{vocab} does not match the sha256 recorded in the manifest")
    assert main(["inspect", dataset, "--verify"]) == 1
    assert f"BAD: {vocab}: sha256" in capsys.readouterr().err


def test_run_directory_errors_are_refused_before_ray(dataset, tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    refused(["train", "--data", dataset, "--run-dir", str(a_file)], capsys,
            f"run directory {a_file} is a file")
    refused(["train", "--data", dataset, "--run-dir", str(a_file / "run")], capsys,
            f"run directory {a_file / 'run'}: {a_file} is a file, not a directory")
    # An export's output is named as such (it was called a run directory).
    from bertforge.training.errors import UserInputError
    from bertforge.training.inputs import check_output_dir
    with pytest.raises(UserInputError, match=f"--output {a_file / 'hf'}: its folder {a_file} is "
                                             "a file, not a directory"):
        check_output_dir(str(a_file / "hf"))
    with pytest.raises(UserInputError, match="--output /proc/hf: its folder /proc is under "
                                             "/proc, a pseudo filesystem"):
        check_output_dir("/proc/hf")
    refused(["train", "--data", dataset, "--run-dir", "/proc/self/run"], capsys,
            "is under /proc, a pseudo filesystem")
    monkeypatch.chdir(tmp_path)
    refused(["train", "--data", dataset, "--run-dir", "gs://bucket/runs/bert"], capsys,
            "run directory gs://bucket/runs/bert is a URI", "--storage gs://")
    assert not os.path.exists("gs:")  # it made one here before
    # A scheme no filesystem serves: pyarrow's words from the run lock, after the run
    # directory was made (and left, empty).
    refused(["train", "--data", dataset, "--run-dir", "r", "--storage", "foo://bucket/x"],
            capsys, "--storage foo://bucket/x: Unrecognized filesystem type", "gs://BUCKET")
    assert not os.path.exists("r")
    (tmp_path / "a-file").write_text("")  # the same, for a local path that is a file
    refused(["train", "--data", dataset, "--run-dir", "r", "--storage", "a-file"],
            capsys, "--storage a-file is a file, not a directory")
    assert not os.path.exists("r")
    # In the dataset (its folder, or one below it): checkpoints among the shards, which a
    # `prepare --overwrite` or deleting the dataset would take with it.
    for inside in (os.path.join(dataset, "train"), dataset):
        refused(["train", "--data", dataset, "--run-dir", inside], capsys,
                f"--run-dir {inside} ", "a prepared dataset; give a folder of its own")
    assert not os.path.exists(os.path.join(dataset, "train", "logs"))
    refused(["export", str(tmp_path), "--output", str(tmp_path / "hf")], capsys,
            "neither a complete checkpoint nor a run with one")
    (tmp_path / "early" / "checkpoints").mkdir(parents=True)  # a run before its first save
    refused(["export", str(tmp_path / "early"), "--output", str(tmp_path / "hf")], capsys,
            f"run {tmp_path / 'early'} has no complete checkpoint yet")
    # One stopped before it made checkpoints/: its metrics and its run config.json, which
    # finetune read as a Hugging Face model's ("is not a BERT model: ... model_type None").
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"step": 1, "loss": 9.8}\n')
    (stopped / "config.json").write_text('{"model": {"hidden_size": 128}, "train": {}}')
    for command in (["export", str(stopped), "--output", str(tmp_path / "hf")],
                    ["finetune", "--task", "sst2", "--model", str(stopped), "--output",
                     str(tmp_path / "ft")]):
        refused(command, capsys, f"run {stopped} has no complete checkpoint yet")


def test_init_from_a_run_without_a_checkpoint_names_the_flag_and_the_run(dataset, tmp_path,
                                                                         capsys):
    """`--init-from` of a run before its first save was "model RUN is neither a complete
    checkpoint, ...": neither the flag nor what the folder is. A run's folder holds its lock and
    the driver's log alone while its workers start; one stopped before its first save also its
    metrics and its recipe's config.json (read as a Hugging Face config by a train without
    --recipe or --preset)."""
    starting = tmp_path / "starting"
    (starting / "logs").mkdir(parents=True)
    (starting / ".lock").write_text("")
    (starting / "logs" / "train.log").write_text("[train] starting Ray\n")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"step": 1, "loss": 9.8}\n')
    (stopped / "config.json").write_text('{"model": {"hidden_size": 128}, "train": {}}')
    new_run = str(tmp_path / "run")
    for run in (starting, stopped):
        for model in ([], ["--preset", "tiny"]):
            refused(["train", "--data", dataset, "--run-dir", new_run, "--init-from", str(run),
                     *model], capsys,
                    f"--init-from {run} is a run directory with no complete checkpoint yet",
                    "wait for one", "or give another checkpoint")
    assert not os.path.exists(new_run)
    refused(["export", str(starting), "--output", str(tmp_path / "hf")], capsys,
            f"run {starting} has no complete checkpoint yet")
    other = tmp_path / "other"
    other.mkdir()
    refused(["train", "--data", dataset, "--run-dir", new_run, "--init-from", str(other)],
            capsys, f"--init-from {other} is neither a complete checkpoint, a run directory "
                    "with one, nor a Hugging Face directory")
    refused(["train", "--data", dataset, "--run-dir", new_run, "--init-from",
             str(tmp_path / "nope")], capsys, f"--init-from {tmp_path / 'nope'}: no such "
                                              "directory")


def test_a_batch_the_workers_or_the_data_cannot_hold_is_refused_before_ray(dataset, tmp_path,
                                                                           capsys):
    """Found in the workers before, where each attempt failed alike (4 tracebacks a worker)."""
    run = ["--data", dataset, "--run-dir", str(tmp_path / "run")]
    refused(["train", *run, "--batch-size", "16", "--global-batch-size", "40", "--workers", "1"],
            capsys, "global_batch_size 40 is not a multiple of micro_batch_size x world_size")
    refused(["train", *run, "--batch-size", "64", "--workers", "2"], capsys,
            "has 70 sequences, fewer than one optimizer step (64 micro x 2 workers x 1 "
            "accumulation = 128)")
    # Values the optimizer or the loop refused in the workers, once per attempt (or, for
    # --checkpoint-every -1, took as 0 without a word); each error names the flag typed.
    refused(["train", *run, "--batch-size", "0"], capsys,
            "--batch-size (micro_batch_size) must be at least 1, got 0")
    refused(["train", *run, "--adam-betas", "1.5", "0.9"], capsys,
            "--adam-betas must be two numbers in [0, 1), got 1.5 0.9")
    # 0 trained NaN weights from the second step on and exited 0.
    refused(["train", *run, "--adam-eps", "0"], capsys, "--adam-eps must be positive, got 0.0")
    refused(["train", *run, "--gradient-clipping", "-1"], capsys,
            "--gradient-clipping must be >= 0 (0: no clip), got -1.0")
    refused(["train", *run, "--checkpoint-every", "-1"], capsys,
            "--checkpoint-every must be >= 0, got -1")
    refused(["train", *run, "--checkpoint-minutes", "nan"], capsys,
            "--checkpoint-minutes must be >= 0, got nan")
    refused(["train", *run, "--seed", "-1"], capsys, "--seed must be in [0, 2**64), got -1")
    refused(["train", *run, "--dataloader-prefetch", "-1"], capsys,
            "--dataloader-prefetch must be >= 0, got -1")
    assert not os.path.exists(tmp_path / "run")


def _cpu_has_fp16() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def test_a_precision_the_cpu_workers_cannot_run_is_refused_before_ray(dataset, tmp_path,
                                                                      capsys):
    """fp16 on a CPU, and fp8 where "auto" is fp32 (the suite's CPUs emulate bf16), failed in
    each Ray worker: four tracebacks after ~50 s. The driver's CPU is a local run's workers'."""
    run = ["--data", dataset, "--run-dir", str(tmp_path / "run"), "--workers", "1"]
    refused(["train", *run, "--fp8"], capsys,
            "fp8 needs the engine's bf16 autocast (bf16 at ZeRO stage 0), not precision fp32: ",
            "(precision auto is fp32 on this CPU: ", "give --precision bf16")
    if not _cpu_has_fp16():
        refused(["train", *run, "--precision", "fp16"], capsys,
                "precision fp16 needs a GPU")
        # A worker that meets it all the same (a cluster's node) ends at once, not retried.
        from bertforge.training.errors import UserInputError

        cfg = TrainConfig(data_dir=dataset, run_dir=str(tmp_path / "worker"), model=TINY,
                          precision="fp16", max_steps=1, micro_batch_size=4)
        with pytest.raises(UserInputError, match="precision fp16 needs a GPU"):
            train(cfg)
    assert not os.path.exists(tmp_path / "run")


def test_an_empty_split_is_said_to_be_empty(tmp_path, capsys):
    """One book prepared holds no document out: its validation split is empty, and eval and
    train --eval-every said "fewer than one optimizer step: give a smaller --batch-size"."""
    data = write_dataset(str(tmp_path / "data"), {"train": [40], "validation": [0]})
    refused(["train", "--data", data, "--run-dir", str(tmp_path / "run"), "--eval-every", "5"],
            capsys, f"split 'validation' of {data} is empty (0 instances)", "--eval-every")
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow  # one real training step (DeepSpeed on the CPU) makes the checkpoint
def test_resume_with_another_architecture_is_one_line(dataset, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(TrainConfig(data_dir=dataset, run_dir=str(run_dir), model=TINY, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=0))
    err = refused(["train", "--data", dataset, "--run-dir", str(run_dir), "--preset", "mini"],
                  capsys, "another architecture", "hidden_size 32 != 256",
                  "name no --preset or --recipe (a resume then trains the run's own model)")
    assert "cannot resume" in err and "step_00000001" in err
    # The CLI's own model (the tiny preset): another precision, or a ZeRO stage across 0 and
    # 1-3, is what no attempt could load (found in the workers before, retried four times).
    tiny_run = tmp_path / "tiny"
    train(TrainConfig(data_dir=dataset, run_dir=str(tiny_run), model={"preset": "tiny"},
                      max_steps=1, micro_batch_size=8, warmup_steps=0, precision="fp32",
                      zero_stage=0))
    resume = ["train", "--data", dataset, "--run-dir", str(tiny_run), "--workers", "1"]
    refused([*resume, "--precision", "bf16"], capsys,
            "was trained in fp32; resuming it in bf16 is not supported")
    refused([*resume, "--precision", "fp32", "--zero-stage", "2"], capsys,
            "under ZeRO stage 0; resuming on 1 worker under ZeRO stage 2 is not supported")
    # What the data order and the optimizer's state were made with (the workers found them,
    # after Ray's start, and retried: "cannot resume: the saved loader state has
    # num_samples=...", a KeyError of LAMB's).
    refused([*resume, "--seed", "7"], capsys, "was trained with --seed 12345", "--seed 12345")
    refused([*resume, "--optimizer", "lamb"], capsys,
            "was trained with --optimizer adamw, whose state it holds")
    other = write_dataset(str(tmp_path / "other"), {"train": [20, 20], "validation": [16]})
    refused(["train", "--data", other, "--run-dir", str(tiny_run), "--workers", "1"], capsys,
            "was trained on a dataset of 70 training samples", f"{other} has 40")
    # The same number of samples, other ones (prepared again with another seed): the run's
    # position in its data order went on among them, silently.
    again = write_dataset(str(tmp_path / "again"), {"train": [40, 30], "validation": [16]},
                          seed=1)
    refused(["train", "--data", again, "--run-dir", str(tiny_run), "--workers", "1"], capsys,
            f"was trained on other samples than the training split of {again} holds (the "
            "same number, 70, but other shards", f"resume on the run's own dataset ({dataset})")
    # The run's own dataset, moved: the same samples, so the run resumes (here: is finished).
    moved = shutil.copytree(dataset, tmp_path / "moved")
    assert main(["train", "--data", str(moved), "--run-dir", str(tiny_run), "--workers",
                 "1"]) == 0
    assert f"{tiny_run} is at step 1 of 1: nothing to train" in capsys.readouterr().out
    assert json.loads((tiny_run / "config.json").read_text())["train"]["optimizer"] == "adamw"
    # eval and export of that checkpoint pass their pre-flight; a used output is refused.
    refused(["export", str(run_dir), "--output", str(tmp_path)], capsys, "exists")
    refused(["export", str(run_dir), "--output", ""], capsys, "--output is empty")
    # The same export again (a scheduler's retry, or one stopped after its last file) is done,
    # not refused; another checkpoint's into that directory is.
    hf = tmp_path / "hf"
    assert main(["export", str(run_dir), "--output", str(hf)]) == 0
    first = capsys.readouterr()
    assert first.out == f"{hf}\n"  # the path alone (`HF=$(bertforge export ...)`)
    written = {name: os.stat(hf / name).st_mtime_ns for name in os.listdir(hf)}
    first_source = json.loads((hf / "config.json").read_text())["bertforge_source"]
    assert main(["export", str(run_dir), "--output", str(hf)]) == 0
    again = capsys.readouterr()
    assert again.err.startswith(f"[export] {hf} already holds this export: nothing to do\n")
    assert again.err.endswith(first.err) and again.out == first.out  # the same source line
    # As a command: its log is the run's, none left in the temporary directory.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-m", "bertforge.cluster.cli", "export", str(run_dir),
                           "--output", str(hf)], capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0 and "already holds this export" in done.stderr, done.stderr
    assert os.listdir(scratch) == [] and (run_dir / "logs" / "export.log").exists()
    assert {name: os.stat(hf / name).st_mtime_ns for name in os.listdir(hf)} == written
    # Damaged from outside (weights cut short, a file gone) it is no longer this export: it
    # was "nothing to do" all the same.
    damaged = tmp_path / "damaged"
    shutil.copytree(hf, damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(damaged / "model.safetensors") - 100)
    refused(["export", str(run_dir), "--output", str(damaged)], capsys,
            f"output {damaged} exists")
    shutil.rmtree(damaged)
    shutil.copytree(hf, damaged)
    (damaged / "vocab.txt").unlink()
    refused(["export", str(run_dir), "--output", str(damaged)], capsys,
            f"output {damaged} exists")
    # A new run there (--resume never) saves other weights under the same step's path: the
    # export no longer holds them ("nothing to do" before, with the old run's weights).
    train(TrainConfig(data_dir=dataset, run_dir=str(run_dir), model=TINY, max_steps=1,
                      micro_batch_size=8, warmup_steps=0, precision="fp32", zero_stage=0,
                      seed=7, resume=False))
    capsys.readouterr()
    # It says which export it holds (whether it is the one wanted was not plain).
    refused(["export", str(run_dir), "--output", str(hf)], capsys,
            f"output {hf} exists, holding the export of run {first_source['run_id']}, step 1; "
            "give a new directory")
    refused(["export", str(tiny_run), "--output", str(hf)], capsys, f"output {hf} exists")
    made_before = tmp_path / "made-before"  # an empty directory is no export: it is used
    made_before.mkdir()
    assert main(["export", str(tiny_run), "--output", str(made_before)]) == 0
    assert (made_before / "config.json").exists()


def test_a_warm_start_of_another_architecture_or_vocabulary_is_refused_before_ray(
        dataset, tmp_path, capsys):
    """Phase 2 from a phase 1 of another shape: found by the worker once Ray had scheduled it
    (minutes on a cluster), now by the driver from the checkpoint's bertforge.json."""
    source = tmp_path / "phase1"
    train(TrainConfig(data_dir=dataset, run_dir=str(source), model={"preset": "tiny"},
                      max_steps=1, micro_batch_size=8, warmup_steps=0, precision="fp32",
                      zero_stage=0))
    phase2 = ["train", "--data", dataset, "--init-from", str(source), "--workers", "1"]
    refused([*phase2, "--run-dir", str(tmp_path / "p2"), "--preset", "mini"], capsys,
            f"init_from {source} has another architecture", "hidden_size 128 != 256")
    # Phase 1 still training there: its newest checkpoint is only where it has got to (phase 2
    # took it, saying so in passing).
    from bertforge.cluster.safety.run_lock import exclusive_directory

    with exclusive_directory(str(source), "train"):
        refused([*phase2, "--run-dir", str(tmp_path / "p2")], capsys,
                f"--init-from {source} is a run still training (bertforge train: host ",
                "step_00000001, is only where it has got to; wait for it to end, or name the "
                "checkpoint to start from")
    # Phase 2's recipe on data of phase 1's length (its shards given by mistake) trained phase
    # 1 again under phase 2's name; longer data, or phase 1's recipe, is what was asked.
    refused([*phase2, "--run-dir", str(tmp_path / "p2"), "--recipe", "bert_tiny_phase2"], capsys,
            f"--recipe bert_tiny_phase2 trains phase 2 at longer sequences than phase 1, but "
            f"{dataset} holds sequences of up to 64 tokens and --init-from {source} was trained "
            "at 64 already (of its 512 positions): give phase 2 a dataset prepared with "
            "--max-seq-length 512")
    longer = write_dataset(str(tmp_path / "longer"), {"train": [40]}, max_seq_length=128)
    for recipe, data in (("bert_tiny_phase2", longer), ("bert_tiny_phase1", dataset)):
        check_phase2_length(recipe, recipes.recipe_by_name(
            recipe, data, str(tmp_path / "p2"), init_from=str(source)))
    latest = checkpoint.latest_checkpoint(str(source))
    metadata_path = os.path.join(latest, checkpoint.METADATA_NAME)
    with open(metadata_path) as f:
        metadata = json.load(f)
    # Phase 1 stopped short of its steps and never resumed: phase 2 from it looked like any
    # other warm start. Said (an early phase 1 may be what is wanted), then taken.
    p2_config = TrainConfig(data_dir=dataset, run_dir=str(tmp_path / "p2"), init_from=str(source))
    warn_of_an_unfinished_source(p2_config)
    assert capsys.readouterr().out == ""  # it ran its 1 step
    with open(metadata_path, "w") as f:
        json.dump({**metadata, "train_config": {**metadata["train_config"], "max_steps": 4}}, f)
    warn_of_an_unfinished_source(p2_config)
    assert capsys.readouterr().out == (
        f"[train] warning: --init-from {source} is a run that stopped at step 1 of its 4: this "
        f"run starts from {latest}; resume that run first (the same command it was started "
        "with) to start from its end\n")
    vocab_path = os.path.join(latest, "vocab.txt")  # as if phase 1 had run on another vocabulary
    with open(vocab_path, "a", encoding="utf-8") as f:
        f.write("[another]\n")
    with open(metadata_path, "w") as f:
        json.dump({**metadata, "vocab_sha256": manifest_lib.sha256_file(vocab_path)}, f)
    refused([*phase2, "--run-dir", str(tmp_path / "p3")], capsys, "another vocabulary")
    assert not os.path.exists(tmp_path / "p2" / "checkpoints")
    # A file where the model's folder goes was "no such directory".
    a_file = os.path.join(dataset, "manifest.json")
    refused(["train", "--data", dataset, "--init-from", a_file, "--run-dir",
             str(tmp_path / "p4")], capsys, f"--init-from {a_file}: a file, not a directory")


def test_byte_flip_is_named_by_inspect_verify(dataset, capsys):
    path = shard(dataset)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        middle = f.read(64)
        f.seek(-64, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in middle))
    assert main(["inspect", dataset, "--verify"]) == 1
    err = capsys.readouterr().err
    bad = [line for line in err.splitlines() if line.startswith("BAD:")]
    assert f"BAD: {path}: sha256" in bad[0]  # and here also the ids the flip made
    assert all(line.startswith(f"BAD: {path}: ") for line in bad), bad  # no other file
    assert main(["inspect", dataset]) == 1  # the statistics see the ids the flip made
    assert f"PROBLEM: {os.path.relpath(path, dataset)}: token id" in capsys.readouterr().out
    not_arrow = shard(dataset, 0)
    shutil.copy(os.path.join(dataset, manifest_lib.VOCAB_NAME), not_arrow)
    assert main(["inspect", dataset]) == 2
    assert f"{not_arrow} is not a readable Arrow IPC file" in capsys.readouterr().err


def test_a_dataset_in_object_storage_without_a_split_the_run_reads_is_refused(tmp_path):
    """A gs:// dataset passed the pre-flight whatever its splits; a missing validation split
    was then a plain error in every worker, retried --max-failures times."""
    from bertforge.training.errors import UserInputError
    from bertforge.training.inputs import check_dataset

    data = write_dataset(str(tmp_path / "data"), {"train": [40]})
    uri = "file://" + os.path.abspath(data)  # the remote path, through pyarrow as gs:// is
    assert check_dataset(uri, ("train",)).split_sizes == {"train": 40}
    with pytest.raises(UserInputError, match=r"has no validation split \(it has train\)"):
        check_dataset(uri, ("train", "validation"))


def test_data_of_the_other_casing_is_refused_for_a_checkpoint(dataset, tmp_path, capsys):
    """The same vocab.txt prepared with --no-lower-case: its ids are other words to a model
    trained lower-cased; eval, a resume and a warm start went on with it."""
    run_dir = tmp_path / "run"
    train(TrainConfig(data_dir=dataset, run_dir=str(run_dir), model={"preset": "tiny"},
                      max_steps=1, micro_batch_size=8, warmup_steps=0, precision="fp32",
                      zero_stage=0))
    cased = str(tmp_path / "cased")
    shutil.copytree(dataset, cased)
    with open(os.path.join(cased, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["tokenizer"]["lower_case"] is True
    manifest["tokenizer"]["lower_case"] = False
    with open(os.path.join(cased, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    why = ("was trained on lower-cased text and", "is cased (the same vocabulary, the other "
           "casing); prepare the data with --lower-case")
    refused(["eval", str(run_dir), "--data", cased], capsys, *why)
    refused(["train", "--data", cased, "--run-dir", str(run_dir), "--workers", "1"], capsys,
            *why)
    refused(["train", "--data", cased, "--run-dir", str(tmp_path / "p2"), "--init-from",
             str(run_dir), "--workers", "1"], capsys, f"init_from {run_dir}", *why)
    # Its Hugging Face export says its casing in tokenizer_config.json.
    hf = str(tmp_path / "hf")
    assert main(["export", str(run_dir), "--output", hf]) == 0
    capsys.readouterr()
    refused(["train", "--data", cased, "--run-dir", str(tmp_path / "p3"), "--init-from", hf,
             "--workers", "1"], capsys, f"init_from {hf}", *why)


# A Cloud Storage endpoint that never answers (the discard port, closed), reached anonymously
# (no credential looked up, whatever the machine has): every request fails to connect, which
# the client retries.
UNREACHABLE_GCS = "endpoint_override=127.0.0.1:9&scheme=http"


@pytest.mark.parametrize("where", ["data", "storage"])
def test_object_storage_out_of_reach_is_one_line_within_the_checks_limit(dataset, tmp_path,
                                                                          where):
    """Without credentials, `train --data gs://...` sat silent for minutes in its pre-flight
    (the client's retry policy; over six measured), then gave a traceback for the storage
    lock. Now each check before the run retries for CHECK_RETRY_SECONDS (2 here), then says
    what failed; a run that never answers is killed by the subprocess timeout, failing."""
    args = {"data": ["--data", f"gs://anonymous@bucket/shards?{UNREACHABLE_GCS}"],
            "storage": ["--data", dataset,
                        "--storage", f"gs://anonymous@bucket/runs?{UNREACHABLE_GCS}"]}
    argv = ["train", *args[where], "--run-dir", str(tmp_path / "run"), "--workers", "1"]
    program = ("import sys; from bertforge.training import object_storage as o; "
               "o.CHECK_RETRY_SECONDS = 2.0; from bertforge.cluster.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("bertforge train")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    # The run's own lock: its name under the storage's path, the URI's query kept.
    expected = {"data": f"gs://anonymous@bucket/shards?{UNREACHABLE_GCS} (manifest.json) could "
                        "not be read (within 2 s of retries)",
                "storage": "the run lock in gs://anonymous@bucket/runs/run-"}
    assert expected[where] in lines[0] and "error_info" not in lines[0], lines[0]
    if where == "storage":
        assert re.search(r"runs/run-[0-9a-f]{10}\?" + re.escape(UNREACHABLE_GCS), lines[0])
