"""`bertforge finetune` end to end through its command-line function: Ray Train workers running
DeepSpeed on the CPU, a tiny BERT, small slices. One local Ray serves the whole module."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil

import pytest
import torch
import transformers

from bertforge.cluster.cli import main
from bertforge.cluster.launch.finetune_workers import local_cores
from tests.support.finetune_data import tiny_bert_dir, write_squad_json, write_sst2_tsv


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    import ray

    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_bert_dir(str(tmp_path_factory.mktemp("model")))


def finetune(*args: str) -> dict:
    assert main(["finetune", *args]) == 0
    output = args[args.index("--output") + 1]
    with open(os.path.join(output, "results.json"), encoding="utf-8") as f:
        return json.load(f)


def same_files(published: str, export: str) -> bool:
    """Whether DIR/hf holds `export`'s files as hard links (a real directory: a copy of it is
    whole, where the symbolic link it was copied as a dangling link)."""
    names = sorted(os.listdir(export))
    return (not os.path.islink(published) and sorted(os.listdir(published)) == names
            and all(os.path.samefile(os.path.join(published, name), os.path.join(export, name))
                    for name in names))


def read_predictions(path: str) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


@pytest.mark.slow
def test_sst2_sweep_on_two_workers_scores_exports_and_reuses_the_runs(model_dir, tmp_path, capsys,
                                                                     monkeypatch):
    write_sst2_tsv(str(tmp_path / "SST-2" / "train.tsv"), 64, seed=1)
    write_sst2_tsv(str(tmp_path / "SST-2" / "dev.tsv"), 32, seed=2)
    # Relative paths, as anyone types them: the user's directory's, not the workers'.
    monkeypatch.chdir(tmp_path)
    train, dev, output = "SST-2/train.tsv", "SST-2/dev.tsv", "out"
    args = ["--task", "SST-2", "--model", os.path.relpath(model_dir), "--output", output,
            "--train", train, "--dev", dev, "--workers", "2", "--batch-size", "16", "--epochs", "2",
            "--sweep", "--sweep-learning-rates", "1e-3", "3e-3", "--seeds", "7"]
    results = finetune(*args)
    out = capsys.readouterr().out
    assert "2 run(s) in one worker group (lr0.001-seed7, lr0.003-seed7)" in out
    assert "[finetune] sst2: accuracy" in out and "2 runs: median" in out

    assert results["task"] == "sst2" and results["primary_metric"] == "accuracy"
    assert results["model"]["kind"] == "hf_dir" and results["model"]["random_init"] is False
    assert results["model"]["source"] == os.path.abspath(model_dir)
    assert results["training"]["world_size"] == 2 and results["training"]["steps"] == 8
    # --workers 2 alone on a local Ray: the machine's cores split between the two workers.
    with open(os.path.join(results["best_run"]["run_dir"], "result.json"),
              encoding="utf-8") as f:
        assert json.load(f)["threads"] == max(1, local_cores() // 2)
    assert results["data"]["num_train_examples"] == 64 and results["config"]["seeds"] == [7]
    sweep = results["sweep"]
    assert sweep["num_runs"] == 2 and [r["learning_rate"] for r in sweep["runs"]] == [1e-3, 3e-3]
    scores = [r["score"] for r in sweep["runs"]]
    assert results["score"] == sweep["best"] == max(scores)
    assert sweep["median"] == pytest.approx(sum(scores) / 2)
    best = sweep["runs"][scores.index(max(scores))]
    assert results["best_run"]["run_dir"] == best["run_dir"]
    assert same_files(results["hf_dir"], os.path.join(best["run_dir"], "hf"))
    other = sweep["runs"][1 - scores.index(max(scores))]
    assert not os.path.exists(os.path.join(other["run_dir"], "hf"))  # only the best is kept
    # The metric is the predictions file's accuracy, one line per dev example.
    rows = read_predictions(results["predictions"])
    assert len(rows) == 32 and [r["line"] for r in rows] == [str(i) for i in range(2, 34)]
    correct = sum(r["prediction"] == r["label"] for r in rows)
    assert results["metrics"]["accuracy"] == pytest.approx(correct / 32)
    # Beside it, what always answering the dev set's commonest label scores, named as the
    # export and the predictions file name it, and whether the run answered one label only
    # (it learned nothing).
    commonest = max(("negative", "positive"), key=lambda label: (
        [r["label"] for r in rows].count(label), label == "negative"))
    chance = sum(r["label"] == commonest for r in rows) / 32
    assert results["chance"] == {"label": commonest, "metrics": {"accuracy": chance}}
    predicted = {r["prediction"] for r in rows}
    assert results["single_label"] == (predicted.pop() if len(predicted) == 1 else None)
    assert f"; always {commonest!r}: accuracy {chance:.4f}" in out
    # The export predicts in transformers what the workers predicted.
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(results["hf_dir"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(results["hf_dir"])
    with open(dev, encoding="utf-8") as f:
        sentences = [line.split("\t")[0] for line in f.read().split("\n")[1:-1]]
    with torch.no_grad():
        logits = hf.eval()(**tokenizer(sentences, padding=True, return_tensors="pt")).logits
    # Its labels are named as GLUE's Hugging Face dataset names them (they were "0" and "1"),
    # and so are the predictions file's (they were the dev file's 0/1 beside results.json's
    # "negative"/"positive").
    assert hf.config.id2label == {0: "negative", 1: "positive"}
    assert [hf.config.id2label[i] for i in logits.argmax(-1).tolist()] == [
        r["prediction"] for r in rows]

    # The same command again: the finished runs are reused, not trained again.
    metrics_file = os.path.join(results["best_run"]["run_dir"], "metrics.jsonl")
    before = os.stat(metrics_file).st_mtime_ns
    again = finetune(*args)
    assert "done in an earlier run, reusing it" in capsys.readouterr().out
    assert os.stat(metrics_file).st_mtime_ns == before
    assert again["metrics"] == results["metrics"]


@pytest.mark.slow
def test_squad_split_of_one_file_reports_exact_match_and_f1(model_dir, tmp_path):
    from bertforge.training.finetune.metrics import squad_evaluate
    from bertforge.training.finetune.squad import read_squad, split_squad

    squad = write_squad_json(str(tmp_path / "squad.json"))
    output = str(tmp_path / "out")
    results = finetune("--task", "squad", "--model", model_dir, "--output", output,
                       "--train", squad, "--dev", squad, "--workers", "1",
                       "--cpus-per-worker", "1", "--max-seq-length", "64",
                       "--max-query-length", "16", "--doc-stride", "16",
                       "--batch-size", "8", "--epochs", "1", "--lr", "1e-3")

    assert results["primary_metric"] == "f1"
    assert set(results["metrics"]) == {"exact_match", "f1"}
    # The worker ran on the threads it was given (the local default would be every core).
    with open(os.path.join(results["best_run"]["run_dir"], "result.json"),
              encoding="utf-8") as f:
        assert json.load(f)["threads"] == 1
    assert "split by article" in results["data"]["note"]
    _, dev = split_squad(read_squad(squad), 0.2, 0)
    with open(results["predictions"], encoding="utf-8") as f:
        predictions = json.load(f)
    assert set(predictions) == {example.id for example in dev}
    assert results["metrics"] == pytest.approx(squad_evaluate(dev, predictions))
    hf = transformers.AutoModelForQuestionAnswering.from_pretrained(results["hf_dir"])
    assert type(hf).__name__ == "BertForQuestionAnswering"


def test_a_model_directory_that_is_not_bert_is_refused_before_ray(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    train = write_sst2_tsv(str(tmp_path / "train.tsv"), 8, seed=1)
    dev = write_sst2_tsv(str(tmp_path / "dev.tsv"), 8, seed=2)
    status = main(["finetune", "--task", "sst2", "--model", str(tmp_path / "gpt2"),
                   "--output", str(tmp_path / "out"), "--train", train, "--dev", dev])
    assert status == 2
    assert "is not a BERT model: its config.json says model_type 'gpt2'" in \
        capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def _strict_json(path) -> dict:
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is no JSON")

    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=refuse)


@pytest.mark.slow
def test_a_diverged_run_is_not_scored_and_a_moved_or_copied_output_is_rerun_in_place(
        model_dir, tmp_path, capsys):
    """A run whose loss became NaN was scored (a Spearman from all-NaN predictions, class 0 for
    NaN logits) and could win its sweep; results.json held NaN. An output moved whole crashed
    its rerun and lost DIR/hf; a copy's DIR/hf pointed into the original."""
    train = write_sst2_tsv(str(tmp_path / "train.tsv"), 32, seed=1)
    dev = write_sst2_tsv(str(tmp_path / "dev.tsv"), 16, seed=2)

    def args(output: str, *rates: str) -> list[str]:
        return ["--task", "sst2", "--model", model_dir, "--output", output, "--train", train,
                "--dev", dev, "--workers", "1", "--batch-size", "16", "--max-steps", "3",
                "--max-seq-length", "32", "--sweep", "--sweep-learning-rates", *rates]

    first = str(tmp_path / "first")
    results = finetune(*args(first, "1e-3", "1e9"))
    out = capsys.readouterr().out
    assert "lr1e+09-seed12345: finished in" in out and "DIVERGED" in out
    assert "1 of them diverged and left out (lr 1e+09 seed 12345)" in out
    assert results["best_run"]["learning_rate"] == 1e-3
    runs = results["sweep"]["runs"]
    assert [run["diverged"] for run in runs] == [False, True] and runs[1]["score"] is None
    assert results["sweep"]["num_diverged"] == 1 and results["sweep"]["num_runs"] == 2
    assert results["sweep"]["median"] == results["score"]  # over the scored run alone
    diverged = _strict_json(os.path.join(runs[1]["run_dir"], "result.json"))
    assert diverged["final_train_loss"] is None and diverged["metrics"] == {}
    assert not os.path.exists(os.path.join(runs[1]["run_dir"], "hf"))  # no NaN model kept
    _strict_json(os.path.join(first, "results.json"))

    # Moved whole, then copied: each reruns where it is, its DIR/hf its own best run's.
    moved = str(tmp_path / "moved")
    os.rename(first, moved)
    copied = str(tmp_path / "copied")
    for output, source in ((moved, None), (copied, moved)):
        if source is not None:
            shutil.copytree(source, output, symlinks=True)
        again = finetune(*args(output, "1e9", "1e-3"))  # the rates in the other order too
        assert capsys.readouterr().out.count("done in an earlier run, reusing it") == 2
        best = os.path.join(output, "runs", "lr0.001-seed12345")
        assert again["best_run"]["run_dir"] == best and again["metrics"] == results["metrics"]
        assert same_files(os.path.join(output, "hf"), os.path.join(best, "hf"))
        assert all(run["run_dir"].startswith(output) for run in again["sweep"]["runs"])

    # Every run diverged: no score, no model, and what to do.
    assert main(["finetune", *args(str(tmp_path / "all"), "1e9")]) == 2
    assert "diverged (its loss or dev logits became NaN), so none has a score: rerun with a " \
        "lower --lr" in capsys.readouterr().err


def test_runs_of_weights_or_data_changed_since_are_not_reused(tmp_path, capsys):
    """MODEL trained further, started again or saved over since the runs, or a data file
    edited: the finished runs were reused ("done in an earlier run") and results.json scored
    the old weights, or the old dev set beside the new one's example count."""
    model = tiny_bert_dir(str(tmp_path / "model"))
    train = write_sst2_tsv(str(tmp_path / "train.tsv"), 16, seed=1)
    dev = write_sst2_tsv(str(tmp_path / "dev.tsv"), 8, seed=2)
    output = tmp_path / "out"
    args = ["--task", "sst2", "--model", model, "--output", str(output), "--train", train,
            "--dev", dev, "--workers", "1", "--batch-size", "8", "--max-steps", "1",
            "--max-seq-length", "32"]
    results = finetune(*args)
    assert results["data"]["sha256"]["dev"] == hashlib.sha256(open(dev, "rb").read()).hexdigest()
    # An output an older bertforge made records no weights or data: it cannot say, and is
    # reused.
    state_path = output / "finetune.json"
    state = json.loads(state_path.read_text())
    assert state["settings"]["model_weights"]["file"] == "model.safetensors"
    del state["settings"]["model_weights"], state["settings"]["data_files"]
    state_path.write_text(json.dumps(state))
    capsys.readouterr()
    finetune(*args)
    assert "done in an earlier run, reusing it" in capsys.readouterr().out
    # Another model's weights of the same size saved over MODEL's, with MODEL's time (`cp -p`,
    # `rsync -t`, `touch -r`): reused as MODEL's, when the time was the key.
    weights = os.path.join(model, "model.safetensors")
    written = os.stat(weights)
    original = open(weights, "rb").read()
    other = tiny_bert_dir(str(tmp_path / "other"), seed=1)
    shutil.copyfile(os.path.join(other, "model.safetensors"), weights)
    os.utime(weights, ns=(written.st_atime_ns, written.st_mtime_ns))
    assert os.path.getsize(weights) == written.st_size
    assert main(["finetune", *args]) == 2
    err = capsys.readouterr().err
    assert f"{output} holds a finetune made with other settings (differs in: " \
        "model_weights.sha256)" in err, err
    # MODEL's own weights back, touched since: the same weights. An older bertforge's record
    # of them (their time, no SHA-256) is compared by the file's name and size.
    with open(weights, "wb") as f:
        f.write(original)
    state = json.loads(state_path.read_text())
    assert set(state["settings"]["model_weights"]) == {"file", "bytes", "sha256"}
    finetune(*args)
    assert "done in an earlier run, reusing it" in capsys.readouterr().out
    del state["settings"]["model_weights"]["sha256"]
    state["settings"]["model_weights"]["modified_ns"] = written.st_mtime_ns
    state_path.write_text(json.dumps(state))
    finetune(*args)
    assert "done in an earlier run, reusing it" in capsys.readouterr().out
    # One dev line's label flipped: other examples.
    lines = open(dev, encoding="utf-8").read().split("\n")
    sentence, label = lines[1].split("\t")
    lines[1] = f"{sentence}\t{1 - int(label)}"
    with open(dev, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    assert main(["finetune", *args]) == 2
    assert "(differs in: data_files.dev)" in capsys.readouterr().err


def test_a_rerun_with_fewer_seeds_fine_tunes_its_best_again_if_its_export_was_removed(
        model_dir, tmp_path, capsys):
    """A sweep keeps only its best run's export. A rerun asking for a subset of its seeds whose
    best was another run removed DIR/hf, and said to rerun into a new --output."""
    train = write_sst2_tsv(str(tmp_path / "train.tsv"), 16, seed=1)
    dev = write_sst2_tsv(str(tmp_path / "dev.tsv"), 8, seed=2)
    output = str(tmp_path / "out")

    def args(*seeds: str) -> list[str]:
        return ["--task", "sst2", "--model", model_dir, "--output", output, "--train", train,
                "--dev", dev, "--workers", "1", "--batch-size", "8", "--max-steps", "2",
                "--max-seq-length", "32", "--lr", "1e-3", "--seeds", *seeds]

    sweep = finetune(*args("1", "2"))
    removed = next(run for run in sweep["sweep"]["runs"]
                   if run["run_dir"] != sweep["best_run"]["run_dir"])
    assert not os.path.exists(os.path.join(removed["run_dir"], "hf"))
    capsys.readouterr()
    alone = finetune(*args(str(removed["seed"])))
    out = capsys.readouterr().out
    assert (f"lr0.001-seed{removed['seed']}: the best of these runs, its export was removed "
            "when an earlier sweep kept only its best's; fine-tuning it again") in out
    # The same seed gave the same model back, and DIR/hf is it.
    assert alone["score"] == removed["score"] and alone["sweep"]["num_runs"] == 1
    assert same_files(os.path.join(output, "hf"), os.path.join(removed["run_dir"], "hf"))
