"""`bertforge glue`: the table (a pure function, hand-made results) and one cheap run of two tiny
tasks through the real engines (Ray Train workers running DeepSpeed), then a rerun that skips."""

from __future__ import annotations

import json
import os

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.commands.glue import (
    GLUE_COLUMNS,
    GlueConfig,
    chance_metrics,
    format_glue_table,
    glue_average,
    model_name,
    task_configs,
)
from tests.support.finetune_data import sst2_lines, tiny_bert_dir, write_sst2_tsv

EVERY_TASK = {
    "cola": {"matthews_corrcoef": 0.5213, "accuracy": 0.81},
    "sst2": {"accuracy": 0.9232},
    "mrpc": {"f1": 0.8857, "accuracy": 0.8431},
    "stsb": {"pearson": 0.8712, "spearman": 0.8694},
    "rte": {"accuracy": 0.6643},
}


def test_the_table_has_the_glue_papers_columns_and_scores_times_100() -> None:
    header, metrics, row = format_glue_table(EVERY_TASK, "bert-mini").split("\n")
    assert header.split() == ["CoLA", "SST-2", "MRPC", "STS-B", "RTE", "Average"]
    assert metrics.split() == ["MCC", "acc", "F1/acc", "P/S", "corr", "acc"]
    # CoLA counts its MCC only; MRPC and STS-B the mean of their two metrics:
    # (52.13 + 92.32 + (88.57 + 84.31) / 2 + (87.12 + 86.94) / 2 + 66.43) / 5 = 76.87
    assert row.split() == ["bert-mini", "52.1", "92.3", "88.6/84.3", "87.1/86.9", "66.4", "76.9"]
    assert glue_average(EVERY_TASK) == pytest.approx(76.87)
    # Each column starts where its header does.
    for title in ("SST-2", "MRPC", "Average"):
        assert row[header.index(title) - 1] == " "


def test_a_most_frequent_class_row_under_the_model_s_where_every_task_has_one() -> None:
    chance = {"cola": {"matthews_corrcoef": 0.0, "accuracy": 0.6913},
              "sst2": {"accuracy": 0.5092}, "mrpc": {"f1": 0.8122, "accuracy": 0.6838},
              "stsb": {"pearson": 0.0, "spearman": 0.0}, "rte": {"accuracy": 0.5271}}
    lines = format_glue_table(EVERY_TASK, "bert-mini", chance).split("\n")
    # (0 + 50.92 + (81.22 + 68.38) / 2 + 0 + 52.71) / 5 = 35.7
    assert lines[3].split() == ["most", "frequent", "class", "0.0", "50.9", "81.2/68.4",
                                "0.0/0.0", "52.7", "35.7"]
    assert lines[2].split()[1:] == ["52.1", "92.3", "88.6/84.3", "87.1/86.9", "66.4", "76.9"]
    # A task without it (a record from before): no row, rather than an average over fewer.
    assert len(format_glue_table(EVERY_TASK, "m", {"sst2": chance["sst2"]}).split("\n")) == 3
    assert chance_metrics("stsb", {}) == {"pearson": 0.0, "spearman": 0.0}
    assert chance_metrics("sst2", {"chance": {"accuracy": 0.5}}) == {"accuracy": 0.5}
    assert chance_metrics("sst2", {"metrics": {}}) is None


def test_missing_tasks_are_dashes_and_the_average_says_over_how_many() -> None:
    results = {"sst2": {"accuracy": 0.8}, "rte": {"accuracy": 0.6}}
    row = format_glue_table(results, "m").split("\n")[2]
    assert row.split() == ["m", "-", "80.0", "-", "-", "60.0", "70.0", "(2", "of", "5", "tasks)"]
    assert format_glue_table({}, "m").split("\n")[2].split() == ["m"] + ["-"] * 6
    assert glue_average({}) is None
    assert [c.task for c in GLUE_COLUMNS] == ["cola", "sst2", "mrpc", "stsb", "rte"]


def test_model_name_labels_the_row(tmp_path) -> None:
    assert model_name(str(tmp_path / "demo" / "hf"), random_init=False) == "demo/hf"
    assert model_name(str(tmp_path / "bert-base-uncased") + "/", random_init=True) == \
        "random init of bert-base-uncased"


def test_per_task_flags_and_unknown_tasks_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="train: set per task"):
        GlueConfig(model="m", finetune={"train": "x.tsv"})
    with pytest.raises(ValueError, match="'qqp' is no GLUE task; bertforge glue runs sst2, "):
        GlueConfig(model="m", tasks=("qqp",))
    # SQuAD and custom tasks are fine-tuning's, which the message says (not "also squad").
    for task in ("squad", "custom"):
        with pytest.raises(ValueError, match=rf"'{task}' is no GLUE task.*bertforge finetune"):
            GlueConfig(model="m", tasks=(task,))
    # Missing GLUE files: the error says where to get them.
    with pytest.raises(ValueError, match="no GLUE task's train.tsv and dev.tsv.*download_glue_"):
        task_configs(GlueConfig(model="m", output=str(tmp_path / "o")), str(tmp_path))
    config = GlueConfig(model="m", tasks=("SST-2",), finetune={"epochs": -1.0})
    write_sst2_tsv(str(tmp_path / "SST-2" / "train.tsv"), 4, seed=0)
    write_sst2_tsv(str(tmp_path / "SST-2" / "dev.tsv"), 4, seed=1)
    with pytest.raises(ValueError, match="epochs must be positive"):
        task_configs(config, str(tmp_path))


def test_a_task_with_one_of_its_two_files_is_said_to_be_left_out(tmp_path, capsys) -> None:
    """A task folder holding dev.tsv alone was skipped without a word (the table's "1 of 5
    tasks" the only trace)."""
    for name in ("train.tsv", "dev.tsv"):
        write_sst2_tsv(str(tmp_path / "SST-2" / name), 4, seed=0)
    write_rte_tsv(str(tmp_path / "RTE" / "dev.tsv"), 4, seed=1)
    assert list(task_configs(GlueConfig(model="m", output=str(tmp_path / "o")),
                             str(tmp_path))) == ["sst2"]
    assert capsys.readouterr().out == (f"[glue] rte: left out, {tmp_path / 'RTE' / 'train.tsv'} "
                                       "is missing\n")


def write_rte_tsv(path: str, num_lines: int, seed: int) -> str:
    """GLUE's RTE layout: index, sentence1, sentence2, an entailment label in words."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("index\tsentence1\tsentence2\tlabel\n")
        for index, (sentence, label) in enumerate(sst2_lines(num_lines, seed)):
            verdict = "entailment" if label else "not_entailment"
            f.write(f"{index}\t{sentence.strip()}\tthe film is good\t{verdict}\n")
    return path


def test_a_refused_glue_leaves_no_output_directory(tmp_path, capsys) -> None:
    """Every task's inputs are checked before DIR is made: a mistyped --model, or a task whose
    files or batch its settings cannot take, used to leave DIR with glue.json and logs/."""
    glue_dir = tmp_path / "glue"
    write_sst2_tsv(str(glue_dir / "SST-2" / "train.tsv"), 32, seed=1)
    write_sst2_tsv(str(glue_dir / "SST-2" / "dev.tsv"), 16, seed=2)
    write_rte_tsv(str(glue_dir / "RTE" / "train.tsv"), 8, seed=3)  # fewer than a batch of 16
    write_rte_tsv(str(glue_dir / "RTE" / "dev.tsv"), 8, seed=4)
    model = tiny_bert_dir(str(tmp_path / "model"))
    output = tmp_path / "out"
    common = ["glue", "--output", str(output), "--glue-dir", str(glue_dir), "--epochs", "1"]
    for argv, message in (
            (["--model", str(tmp_path / "no-model"), "--tasks", "sst2"],
             f"model {tmp_path / 'no-model'}: no such directory"),
            # A file where a folder goes: "no such directory" of a path that exists.
            (["--model", model, "--glue-dir", str(glue_dir / "SST-2" / "dev.tsv")],
             f"--glue-dir {glue_dir / 'SST-2' / 'dev.tsv'}: a file, not a directory"),
            (["--model", model, "--tasks", "sst2", "--batch-size", "15", "--workers", "2"],
             "--batch-size 15 is not a multiple of --workers 2"),
            (["--model", model, "--batch-size", "16"],  # sst2 is fine, rte is not
             f"{glue_dir / 'RTE' / 'train.tsv'}: 8 training examples are fewer than one batch")):
        assert main([*common, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bertforge glue: error: {message}"), err
        assert not output.exists(), sorted(os.listdir(output))


@pytest.mark.slow
def test_two_tiny_tasks_end_to_end_then_a_rerun_skips_them(tmp_path, capsys) -> None:
    import ray

    glue_dir = tmp_path / "glue"
    write_sst2_tsv(str(glue_dir / "SST-2" / "train.tsv"), 32, seed=1)
    write_sst2_tsv(str(glue_dir / "SST-2" / "dev.tsv"), 16, seed=2)
    write_rte_tsv(str(glue_dir / "RTE" / "train.tsv"), 32, seed=3)
    write_rte_tsv(str(glue_dir / "RTE" / "dev.tsv"), 16, seed=4)
    model = tiny_bert_dir(str(tmp_path / "model"))
    output = tmp_path / "out"
    args = ["glue", "--model", model, "--output", str(output), "--glue-dir", str(glue_dir),
            "--workers", "1", "--batch-size", "16", "--epochs", "1", "--lr", "1e-3",
            "--max-seq-length", "32"]
    try:
        assert main(args) == 0
        printed = capsys.readouterr().out
        record = json.loads((output / "glue.json").read_text())
        assert main(args) == 0  # every task is done: no training
        again = capsys.readouterr().out
        assert not ray.is_initialized()  # one worker on this machine: no Ray was started
    finally:
        ray.shutdown()

    glue = record["glue"]
    assert glue["tasks_run"] == ["sst2", "rte"] and glue["tasks_missing"] == ["cola", "mrpc",
                                                                               "stsb"]
    for task in ("sst2", "rte"):
        results = json.loads((output / task / "results.json").read_text())
        assert results["training"]["steps"] == 2 and results["config"]["learning_rate"] == 1e-3
        assert glue["results"][task] == results["metrics"]
        assert record["stages"][task]["results"] == str(output / task / "results.json")
        # The task's own runs' time, not the whole glue's (every task said the same 64 s).
        runs = results["sweep"]["runs"]
        assert results["seconds"] == pytest.approx(sum(run["seconds"] for run in runs), abs=0.11)
    expected = (glue["results"]["sst2"]["accuracy"] + glue["results"]["rte"]["accuracy"]) * 50
    assert glue["average"] == pytest.approx(expected)
    assert glue["table"] in printed and glue["table"].split("\n")[2].startswith("tiny-bert ")
    # Under it, what always answering each dev set's commonest label scores.
    for task in ("sst2", "rte"):
        results = json.loads((output / task / "results.json").read_text())
        assert glue["most_frequent_class"][task] == results["chance"]["metrics"]
    chance = glue["most_frequent_class"]
    assert glue["table"].split("\n")[3].split()[-5:] == [
        f"{(chance['sst2']['accuracy'] + chance['rte']['accuracy']) * 50:.1f}", "(2", "of", "5",
        "tasks)"]
    assert glue["table"].split("\n")[3].startswith("most frequent class ")
    # --workers 1 on this machine: one worker process, no Ray.
    assert ("2 run(s) in one local worker process (sst2/runs/lr0.001-seed12345, rte/runs/"
            in printed)
    assert again.count("done in an earlier run, reusing it") == 2 and glue["table"] in again

    # The tasks named in another order, a subset, another seed: no other settings (each was
    # refused, "differs in: tasks"); only the missing run trains.
    assert main([*args, "--tasks", "rte", "sst2"]) == 0
    assert capsys.readouterr().out.count("done in an earlier run, reusing it") == 2
    assert main([*args, "--tasks", "rte", "--seeds", "12345", "7"]) == 0
    more = capsys.readouterr().out
    assert "1 run(s) in one local worker process (lr0.001-seed7)" in more, more
    rte = json.loads((output / "rte" / "results.json").read_text())
    assert [run["seed"] for run in rte["sweep"]["runs"]] == [12345, 7]

    # A flag typed at its default value is the same recipe (it was "differs in:
    # finetune.warmup_fraction").
    assert main([*args, "--tasks", "rte", "--seeds", "12345", "7", "--warmup-fraction",
                 "0.1"]) == 0
    assert "[glue] [1/1] rte: done in an earlier run, reusing it" in capsys.readouterr().out
    # Fewer seeds: the table is theirs (it printed the larger sweep's best).
    assert main([*args, "--tasks", "rte", "--seeds", "7"]) == 0
    capsys.readouterr()
    record = json.loads((output / "glue.json").read_text())
    seven = next(run for run in rte["sweep"]["runs"] if run["seed"] == 7)
    assert record["stages"]["rte"]["runs"] == [[1e-3, 7]]
    assert record["glue"]["results"]["rte"] == seven["metrics"]
    # An edited dev file: not the runs' data (their old scores were printed).
    dev = glue_dir / "RTE" / "dev.tsv"
    dev.write_text(dev.read_text().replace("\tnot_entailment\n", "\tentailment\n", 1))
    assert main([*args, "--tasks", "rte", "--seeds", "7"]) == 2
    assert f"{output / 'rte'} holds a finetune made with other settings (differs in: " \
        "data_files.dev)" in capsys.readouterr().err
