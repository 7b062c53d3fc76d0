"""The demo's own code path, smaller: docstrings -> vocab -> Beam (2 processes) -> Ray Train
(2 workers, DeepSpeed ZeRO-2, precision auto) -> eval -> Hugging Face export, then a second run."""

import json
import os

import pytest

from bertforge.cluster.demo import DemoConfig, run_demo

pytestmark = pytest.mark.slow


def small_demo(output) -> DemoConfig:
    return DemoConfig(
        output=str(output), corpus_mb=0.4, vocab_size=2000, num_shards=2,
        max_steps=24, micro_batch_size=16, learning_rate=1e-3,
        finetune_train_examples=64, finetune_dev_examples=48, finetune_epochs=1.0,
        finetune_max_seq_length=32, finetune_batch_size=16,
    )


@pytest.fixture(scope="module")
def finished_demo(tmp_path_factory):
    import ray

    output = tmp_path_factory.mktemp("demo") / "out"
    summary = run_demo(small_demo(output))
    ray.shutdown()
    return output, summary


def test_summary_has_every_number_and_training_lowered_the_loss(finished_demo):
    output, summary = finished_demo
    on_disk = json.loads((output / "summary.json").read_text())
    assert on_disk == summary
    for key in ("steps", "loss_first", "loss_last", "mlm_accuracy", "mlm_baseline_accuracy",
                "nsp_accuracy", "tokens_per_second", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 24
    assert summary["loss_last"] < summary["loss_first"]
    assert 0 < summary["mlm_baseline_accuracy"] < 1 and 0 < summary["nsp_accuracy"] < 1
    assert summary["tokens_per_second"] > 0
    assert (output / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_worker_logs_stay_in_the_run_directory(finished_demo):
    """The console got our lines; each worker's full output, library warnings included, is in
    RUN_DIR/logs (cluster.launch.worker_output)."""
    output, _ = finished_demo
    logs = sorted((output / "run" / "logs").glob("worker-*.log"))
    assert [p.name for p in logs] == ["worker-0.log", "worker-1.log"]
    assert "[train] step 24/24" in logs[0].read_text()


def test_sst2_from_the_pretrained_model_from_random_init_and_bag_of_words(finished_demo):
    _, summary = finished_demo
    finetune = summary["finetune_sst2"]  # on the SST-2 subset shipped with bertforge
    assert finetune["shipped"] and "skipped" not in finetune
    pretrained, random_init = finetune["pretrained"], finetune["random_init"]
    assert pretrained["steps"] == random_init["steps"] == 4  # 64 sentences / 16 = 4 per epoch
    for run in (pretrained, random_init, finetune["bag_of_words"]):
        assert 0.0 <= run["accuracy"] <= 1.0
        assert (run["train_examples"], run["dev_examples"]) == (64, 48)
    assert pretrained["train_seconds"] > 0 and random_init["train_seconds"] > 0
    assert finetune["finetune_seconds"] > pretrained["train_seconds"] + random_init["train_seconds"]
    # One worker group ran both: its logs (under the first job's runs/) hold both runs' steps.
    root = os.path.join(summary["hf_dir"], os.pardir, "finetune")
    worker_log = open(os.path.join(root, "pretrained", "runs", "logs", "worker-0.log")).read()
    assert worker_log.count("[finetune] step 4/4") == 4  # each model at each of two rates
    # Each model is read at its best rate (at one rate, the rate decided the comparison).
    for run in (pretrained, random_init):
        by_rate = run["accuracy_by_learning_rate"]
        assert set(by_rate) == {"0.0003", "0.001"}
        assert run["accuracy"] == max(by_rate.values()) == by_rate[f"{run['learning_rate']:g}"]
    assert not os.path.exists(os.path.join(root, "random_init", "runs", "logs"))
    # The bar both runs are read against: always the commonest label of the 48 dev sentences
    # (the predictions file's label column, in the label names results.json uses), and
    # whether a run gave one label throughout.
    results = [json.loads(open(r["results"]).read()) for r in (pretrained, random_init)]
    for run, result in zip((pretrained, random_init), results, strict=True):
        with open(result["predictions"], encoding="utf-8") as f:
            rows = [line.split("\t") for line in f.read().splitlines()[1:]]
        labels = [label for _, _, label in rows]
        assert set(labels) <= {"negative", "positive"}
        commonest = max(("negative", "positive"),
                        key=lambda label: (labels.count(label), label == "negative"))
        assert run["chance"] == {"label": commonest,
                                 "metrics": {"accuracy": labels.count(commonest) / 48}}
        predicted = {prediction for _, prediction, _ in rows}
        assert run["single_label"] == (predicted.pop() if len(predicted) == 1 else None)
    assert [r["model"]["random_init"] for r in results] == [False, True]
    assert results[0]["config"]["model"] == summary["hf_dir"]


def test_shards_follow_the_contract_with_a_document_held_out_split(finished_demo):
    import pyarrow as pa

    from bertforge.pipelines.contract.manifest import read_manifest

    output, _ = finished_demo
    manifest = read_manifest(str(output / "shards"))
    assert set(manifest.splits) == {"train", "validation"}
    doc_ids = {}
    for split, entry in manifest.splits.items():
        ids = set()
        for shard in entry.shards:
            with pa.memory_map(str(output / "shards" / shard.path)) as source:
                table = pa.ipc.open_file(source).read_all()
            assert table.num_rows == shard.num_rows
            ids.update(table.column("doc_id").to_pylist())
        doc_ids[split] = ids
    assert doc_ids["train"] and doc_ids["validation"]
    assert not doc_ids["train"] & doc_ids["validation"]


def test_export_loads_in_transformers_and_predicts_like_our_checkpoint(finished_demo):
    import torch
    from transformers import BertForPreTraining, BertTokenizerFast

    from bertforge.training.checkpoint import latest_checkpoint, load_model

    output, _ = finished_demo
    hf_model = BertForPreTraining.from_pretrained(str(output / "hf")).eval()
    tokenizer = BertTokenizerFast.from_pretrained(str(output / "hf"))
    ours, _ = load_model(latest_checkpoint(str(output / "run")))
    ours.eval()
    batch = tokenizer(["Return the sum of the values.", "Raise an error if the file is empty."],
                      ["The list must not be empty.", "Open the file for reading."],
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf_model(**batch)
        mine = ours(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"])
    assert torch.allclose(theirs.prediction_logits, mine.prediction_logits, atol=1e-4)
    assert torch.allclose(theirs.seq_relationship_logits, mine.seq_relationship_logits, atol=1e-4)


def test_second_run_reuses_every_stage(finished_demo, capsys):
    output, summary = finished_demo
    again = run_demo(small_demo(output))
    printed = capsys.readouterr().out
    assert printed.count("done in an earlier run, reusing it") == 7
    assert {k: again[k] for k in ("mlm_accuracy", "nsp_accuracy", "loss_last")} == {
        k: summary[k] for k in ("mlm_accuracy", "nsp_accuracy", "loss_last")
    }


def test_other_settings_or_a_foreign_directory_are_refused(finished_demo, tmp_path):
    output, _ = finished_demo
    changed = small_demo(output)
    changed.max_steps = 30
    with pytest.raises(ValueError, match="other settings .*max_steps"):
        run_demo(changed)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        run_demo(small_demo(foreign))
    assert os.listdir(foreign) == ["notes.txt"]  # nothing written into someone else's directory
