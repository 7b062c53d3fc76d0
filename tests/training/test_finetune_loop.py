"""The fine-tuning loop in this process (DeepSpeed on the CPU, gloo, one rank): it learns a
learnable task, and the same seed gives the same run bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bertforge.training.finetune.config import FinetuneConfig
from bertforge.training.finetune.loop import finetune
from tests.support.finetune_data import tiny_bert_dir, write_sst2_tsv


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("finetune"))
    return {"model": tiny_bert_dir(root),
            "train": write_sst2_tsv(os.path.join(root, "train.tsv"), 128, seed=1),
            "dev": write_sst2_tsv(os.path.join(root, "dev.tsv"), 48, seed=2)}


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as a Ray worker with one CPU runs: on a busy 2-core machine two threads
    contend for every op (20x slower measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(files, output, **overrides) -> tuple[dict, str]:
    values = dict(task="sst2", model=files["model"], output=str(output), train=files["train"],
                  dev=files["dev"], learning_rate=3e-3, epochs=8, batch_size=16, log_every=100)
    values.update(overrides)
    record = finetune(FinetuneConfig(**values))
    with open(record["predictions"], encoding="utf-8") as f:
        return record, f.read()


def test_same_seed_same_run_and_the_task_is_learned(files, tmp_path):
    first, first_predictions = run(files, tmp_path / "a")
    second, second_predictions = run(files, tmp_path / "b")
    assert first["final_train_loss"] == second["final_train_loss"]
    assert first["metrics"] == second["metrics"] and first_predictions == second_predictions
    # The label is the sentiment word a sentence holds: 64 steps learn it.
    assert first["metrics"]["accuracy"] >= 0.9, first["metrics"]
    # fp32: the suite answers "no native bf16" for every CPU (tests/conftest.py).
    assert first["steps"] == 64 and first["precision"] == "fp32"
    with open(tmp_path / "a" / "result.json", encoding="utf-8") as f:
        assert json.load(f)["metrics"] == first["metrics"]
    # Each logged rate is the one its step trained at (it was the next step's: the last 0):
    # 64 steps, 10 % warm-up (6 steps), then linear decay to 0 after step 64.
    with open(tmp_path / "a" / "metrics.jsonl", encoding="utf-8") as f:
        logged = {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
    assert logged[1] == pytest.approx(3e-3 / 6) and logged[64] == pytest.approx(3e-3 / 58)

    other, _ = run(files, tmp_path / "c", seeds=(99,))
    assert other["final_train_loss"] != first["final_train_loss"]


def test_the_export_keeps_the_length_its_model_was_trained_at(files, tmp_path):
    """A fine-tune's hf/ said model_max_length 512 for a model pretrained at 128 tokens (as
    `bertforge export` writes it): transformers then truncated at 512 untrained positions, and
    a fine-tune from that hf/ lost the warning about them."""
    import shutil

    model = tmp_path / "pretrained-at-128"
    shutil.copytree(files["model"], model)
    tokenizer_config = model / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()),
                                            "model_max_length": 128}))
    record, _ = run(files, tmp_path / "ft", model=str(model), epochs=1, max_seq_length=64)
    written = json.loads((tmp_path / "ft" / "hf" / "tokenizer_config.json").read_text())
    assert record["model"]["positions_trained"] == 128 and written["model_max_length"] == 128


def test_on_a_cpu_with_native_bf16_auto_fine_tunes_in_bf16_and_repeats_bit_for_bit(
    files, tmp_path, monkeypatch
):
    """The branch a Zen 4 or Sapphire Rapids machine takes by default, taken on any machine
    (bf16 is emulated where the CPU lacks it: one short epoch)."""
    monkeypatch.setenv("BERTFORGE_CPU_BF16", "native")
    first, first_predictions = run(files, tmp_path / "a", epochs=1)
    second, second_predictions = run(files, tmp_path / "b", epochs=1)
    assert first["precision"] == "bf16" and first["steps"] == 8
    assert first["final_train_loss"] == second["final_train_loss"]
    assert first_predictions == second_predictions


def test_custom_task_reads_its_labels_from_the_train_file_and_random_init_runs(files, tmp_path):
    record, predictions = run(files, tmp_path / "custom", task="custom", text_columns=("sentence",),
                              label_column="label", random_init=True, max_steps=2)
    assert record["model"]["random_init"] is True and record["steps"] == 2
    assert set(record["metrics"]) == {"accuracy", "f1"}
    assert predictions.splitlines()[0] == "line\tprediction\tlabel"
    labels = {line.split("\t")[2] for line in predictions.splitlines()[1:]}
    assert labels == {"0", "1"}


@pytest.mark.parametrize("task", ["cola", "mrpc", "rte", "stsb"])
def test_every_glue_task_runs_on_a_slice_of_its_real_files(task, tmp_path):
    """GLUE's own files (no header in CoLA, a BOM in MRPC, word labels in RTE, scores in
    STS-B) through the loop: metrics of the task, one prediction a dev line."""
    from bertforge.training.finetune.tasks import glue_dir_files, task_spec

    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
    spec = task_spec(task)
    if not os.path.isfile(os.path.join(root, "glue", spec.train_file)):
        pytest.skip(f"../shared/data/glue/{spec.train_file} is not on this machine")
    train, dev = glue_dir_files(os.path.join(root, "glue"), spec)
    model = tiny_bert_dir(str(tmp_path / "model"),
                          vocab_path=os.path.join(root, "bert-base-uncased-vocab.txt"))
    record, predictions = run({"model": model, "train": train, "dev": dev}, tmp_path / "out",
                              task=task, max_train_examples=32, max_dev_examples=24,
                              max_steps=2)
    assert set(record["metrics"]) == set(spec.metrics)
    assert all(-1.0 <= value <= 1.0 for value in record["metrics"].values()), record["metrics"]
    rows = [line.split("\t") for line in predictions.splitlines()[1:]]
    assert len(rows) == 24
    if spec.is_regression:
        assert all(0.0 <= float(row[2]) <= 5.0 for row in rows)
    else:  # named as results.json and the export name them: CoLA's 0/1 as (un)acceptable
        assert {row[2] for row in rows} <= set(spec.exported_labels)
        assert {row[1] for row in rows} <= set(spec.exported_labels)
        if record["single_label"] is not None:
            assert {row[1] for row in rows} == {record["single_label"]}


def test_squad_runs_on_an_article_split_of_the_real_dev_file(tmp_path):
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
    squad = os.path.join(root, "squad", "dev-v1.1.json")
    if not os.path.isfile(squad):
        pytest.skip("../shared/data/squad/dev-v1.1.json is not on this machine")
    model = tiny_bert_dir(str(tmp_path / "model"),
                          vocab_path=os.path.join(root, "bert-base-uncased-vocab.txt"))
    record, predictions = run({"model": model, "train": squad, "dev": squad}, tmp_path / "out",
                              task="squad", max_train_examples=32, max_dev_examples=16,
                              max_steps=1, batch_size=8)
    assert set(record["metrics"]) == {"exact_match", "f1"}
    assert 0.0 <= record["metrics"]["f1"] <= 100.0
    answers = json.loads(predictions)
    assert len(answers) == 16 and all(isinstance(a, str) for a in answers.values())
    assert record["train_rows"] >= record["train_examples"] == 32  # long contexts: windows


def test_fine_tuning_steps_frozen_after_its_first_log_line_and_ends_unfrozen(
        files, tmp_path, monkeypatch):
    """As pretraining's loop (training/host_gc.py): from the first log line on, what is alive
    is frozen, so no full collection walks it inside a step; nothing stays frozen after."""
    import gc

    from bertforge.training.finetune import loop as finetune_loop

    seen = []
    log = finetune_loop.MetricsLogger.log

    def noting_the_freeze(self, step, values):
        seen.append((step, gc.get_freeze_count()))
        return log(self, step, values)

    monkeypatch.setattr(finetune_loop.MetricsLogger, "log", noting_the_freeze)
    run(files, tmp_path / "run", epochs=2, log_every=4)  # 16 steps: lines at 1, 4, ..., 16
    train_lines = [(step, count) for step, count in seen if step <= 16][:5]
    assert [step for step, _ in train_lines] == [1, 4, 8, 12, 16]
    assert train_lines[0][1] == 0 and all(count > 1000 for _, count in train_lines[1:])
    assert gc.get_freeze_count() == 0


def test_a_regression_dev_predictions_file_holds_the_scores_that_were_scored(tmp_path):
    """Near-equal scores were written to 6 digits: ties in the file that the model did not
    make, so a Spearman recomputed from dev_predictions.tsv was not the reported one."""
    from types import SimpleNamespace

    import numpy as np

    from bertforge.training.finetune.loop import write_glue_predictions

    scores = np.array([2.0000001, 2.0000002, 2.0000005, -1.2345678e-7], dtype=np.float32)
    examples = [SimpleNamespace(line=i + 2, label=float(i)) for i in range(len(scores))]
    data = SimpleNamespace(spec=SimpleNamespace(labels=None, exported_labels=None),
                           dev_examples=examples)
    path = tmp_path / "dev_predictions.tsv"
    write_glue_predictions(str(path), data, scores)
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
    assert np.array_equal(np.array([row[1] for row in rows], dtype=np.float32), scores)


def test_dev_predictions_name_the_labels_as_results_json_does(tmp_path):
    """SST-2's file says 0/1; results.json, the console ("predicted 'negative' for every dev
    example") and the export say negative/positive, and the predictions file said 0/1."""
    from types import SimpleNamespace

    import numpy as np

    from bertforge.training.finetune.loop import write_glue_predictions
    from bertforge.training.finetune.tasks import task_spec

    examples = [SimpleNamespace(line=2, label=1), SimpleNamespace(line=3, label=0)]
    data = SimpleNamespace(spec=task_spec("sst2"), dev_examples=examples)
    path = tmp_path / "dev_predictions.tsv"
    write_glue_predictions(str(path), data, np.array([0, 0]))
    assert path.read_text().splitlines() == [
        "line\tprediction\tlabel", "2\tnegative\tpositive", "3\tnegative\tnegative"]


def test_a_model_without_a_pooler_says_its_pooler_starts_random(files, tmp_path, capsys):
    """A BertForMaskedLM save (many released BERTs) fine-tuned with a random pooler under the
    classifier, said only in results.json's provenance."""
    import shutil

    import transformers

    full = transformers.BertForPreTraining.from_pretrained(files["model"])
    masked_lm = transformers.BertForMaskedLM(full.config)
    masked_lm.load_state_dict(full.state_dict(), strict=False)
    masked_lm.save_pretrained(tmp_path / "mlm")
    shutil.copy(os.path.join(files["model"], "vocab.txt"), tmp_path / "mlm")
    capsys.readouterr()
    record, _ = run({**files, "model": str(tmp_path / "mlm")}, tmp_path / "out", max_steps=1)
    assert record["model"]["pooler"] == "initialised randomly (the source has none)"
    assert (f"[finetune] {tmp_path / 'mlm'} has no pooler (a masked-LM-only save): the "
            "classifier's pooler starts from random weights") in capsys.readouterr().out
