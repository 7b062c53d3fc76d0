import os

import pyarrow as pa
import pytest

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.dataset_stats import format_report, inspect_dataset
from bertforge.pipelines.verify_dataset import verify_dataset

# Google's layout: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then words.
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "down"]


def test_statistics_match_the_manifest(prepared):
    data_dir, _ = prepared
    found = manifest.read_manifest(data_dir)
    stats = inspect_dataset(data_dir, num_samples=4)
    assert set(stats["splits"]) == set(found.splits)
    for name, split in stats["splits"].items():
        assert split["num_rows"] == found.splits[name].num_instances
        assert split["num_tokens"] == found.splits[name].num_tokens
        assert split["problems"] == []
        assert sum(b["count"] for b in split["length"]["histogram"]) == split["num_rows"]
        assert split["length"]["max"] <= found.instance_params["max_seq_length"]
        nsp = split["nsp"]
        assert nsp["real_next"] + nsp["random_next"] == split["num_rows"]
    assert 0.3 < stats["splits"]["train"]["nsp"]["random_share"] < 0.7


def test_samples_are_decoded_per_segment(prepared):
    data_dir, _ = prepared
    stats = inspect_dataset(data_dir, num_samples=4)
    assert len(stats["samples"]) == 4
    for sample in stats["samples"]:
        assert sample["a"] and sample["b"]
        assert "[SEP]" not in sample["a"] + sample["b"] and "[CLS]" not in sample["a"]
        assert sample["next_sentence_label"] in (0, 1)
    report = format_report(stats)
    for text in (
        "train:",
        "validation:",
        "NSP:",
        "length:",
        "A: ",
        "B: ",
        stats["samples"][0]["doc_id"],
    ):
        assert text in report
    for split in stats["splits"].values():  # "1 shards" before
        shards = split["num_shards"]
        assert f" {shards} shard{'' if shards == 1 else 's'} (rows" in report


def _write_dataset(root: str, rows: list[tuple[list[int], int, int]]) -> str:
    """A one-shard dataset written by the manifest contract: rows of (ids, num_a, label)."""
    os.makedirs(root)
    vocab_path = os.path.join(root, manifest.VOCAB_NAME)
    with open(vocab_path, "w", encoding="utf-8") as f:
        f.write("\n".join(VOCAB) + "\n")
    relative = manifest.shard_file_name("train", 0, 1)
    table = pa.table({manifest.INPUT_IDS: [r[0] for r in rows],
                      manifest.NUM_A_TOKENS: [r[1] for r in rows],
                      manifest.NEXT_SENTENCE_LABEL: [r[2] for r in rows],
                      manifest.DOC_ID: [f"d{i}" for i in range(len(rows))]},
                     schema=manifest.shard_schema(len(VOCAB)))
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)  # several record batches: rows count on
    num_tokens = sum(len(r[0]) for r in rows)
    manifest.write_manifest(root, manifest.Manifest(
        tokenizer=manifest.TokenizerEntry(vocab_sha256=manifest.sha256_file(vocab_path),
                                          vocab_size=len(VOCAB), lower_case=True),
        instance_params={"max_seq_length": 16},
        splits={"train": manifest.SplitEntry(
            num_instances=len(rows), num_tokens=num_tokens, num_documents=len(rows),
            shards=[manifest.ShardEntry(path=relative, num_rows=len(rows), num_tokens=num_tokens,
                                        sha256=manifest.sha256_file(path))])},
        counts={"documents": len(rows), "sentences": 0, "instances": len(rows), "rejected": {}},
    ))
    return path


def test_verify_checks_every_row_as_the_loader_does(tmp_path):
    good = ([2, 5, 3, 6, 3], 3, 0)  # [CLS] the [SEP] cat [SEP]
    path = _write_dataset(str(tmp_path / "ok"), [good] * 5)
    assert verify_dataset(str(tmp_path / "ok")).ok
    # Row 3 (in the second record batch): num_a_tokens 2 points before A's [SEP]. Every id is
    # in the vocabulary and the manifest's hashes match: only the row check can see it.
    rows = [good] * 3 + [([2, 5, 3, 6, 3], 2, 0)] + [good]
    path = _write_dataset(str(tmp_path / "bad"), rows)
    result = verify_dataset(str(tmp_path / "bad"))
    assert result.problems == [
        f"{path}: num_a_tokens 2 outside [3, length - 2 = 3] in row 3 "
        "(1 bad row(s) in its record batch of 2)"]
    problems = inspect_dataset(str(tmp_path / "bad"), num_samples=0)["splits"]["train"]["problems"]
    assert problems == [result.problems[0].replace(path, manifest.shard_file_name("train", 0, 1))]


def test_inspect_of_a_dataset_without_its_vocabulary_says_what_is_missing(tmp_path):
    _write_dataset(str(tmp_path / "data"), [([2, 5, 3, 6, 3], 3, 0)])
    os.remove(tmp_path / "data" / manifest.VOCAB_NAME)
    with pytest.raises(FileNotFoundError, match=r"vocab.txt is missing: every prepared dataset "
                                                r"holds the vocabulary its ids index"):
        inspect_dataset(str(tmp_path / "data"))


def test_inspect_of_a_dataset_without_a_shard_says_it_is_missing(tmp_path):
    """It said "is not a readable Arrow IPC file ([Errno 2] Failed to open local file ...)"."""
    path = _write_dataset(str(tmp_path / "data"), [([2, 5, 3, 6, 3], 3, 0)])
    os.remove(path)
    with pytest.raises(ValueError) as error:
        inspect_dataset(str(tmp_path / "data"))
    assert str(error.value) == (f"{path} is missing (the manifest lists it): copy it back, or "
                                "prepare the dataset again")


def test_verify_names_shards_the_manifest_does_not_list(tmp_path):
    """A shard another dataset left in the directory: a reader globbing `train/*.arrow` would
    read it, so --verify names it (it said "4 files ... match the manifest")."""
    path = _write_dataset(str(tmp_path / "data"), [([2, 5, 3, 6, 3], 3, 0)] * 2)
    stale = tmp_path / "data" / manifest.shard_file_name("train", 1, 4)
    stale.write_bytes(open(path, "rb").read())
    (tmp_path / "data" / "train" / "notes.txt").write_text("the user's own file: not a shard")
    assert verify_dataset(str(tmp_path / "data")).problems == [
        f"{stale}: a shard the manifest does not list (left by another dataset?): remove it"]


def test_verify_names_specials_out_of_place_and_bad_labels(tmp_path):
    rows = [([2, 5, 3, 6, 3], 3, 0), ([2, 5, 6, 3, 3], 3, 0), ([2, 5, 3, 6, 3], 3, 2)]
    path = _write_dataset(str(tmp_path / "data"), rows)
    (problem,) = verify_dataset(str(tmp_path / "data")).problems
    assert problem.startswith(f"{path}: [CLS]/[SEP] are not where")
    assert " in row 1 (" in problem


def test_inspect_of_a_file_or_a_negative_sample_count_is_one_line(tmp_path, capsys):
    """`inspect afile` said `afile/manifest.json not found`; `--samples -1` was taken."""
    from tests.support.refusals import refused

    afile = tmp_path / "afile"
    afile.write_text("not a dataset\n")
    refused(["inspect", str(afile)], capsys, f"{afile} is a file, not a prepared dataset")
    _write_dataset(str(tmp_path / "data"), [([2, 5, 3, 6, 3], 3, 0)])
    refused(["inspect", str(tmp_path / "data"), "--samples", "-1"], capsys,
            "--samples must be at least 0, got -1")
    # Object storage: it said "manifest.json not found" of a dataset that is there.
    refused(["inspect", "gs://bucket/shards"], capsys,
            "gs://bucket/shards: inspect reads a dataset on this machine")


def test_verify_names_a_casing_edited_in_one_of_the_manifests_two_records(tmp_path):
    """lower_case flipped by hand in the manifest's tokenizer verified clean, and the export's
    do_lower_case and every casing check then followed it; prepare writes it twice."""
    import json

    _write_dataset(str(tmp_path / "data"), [([2, 5, 3, 6, 3], 3, 0)])
    path = tmp_path / "data" / manifest.MANIFEST_NAME
    values = json.loads(path.read_text())
    values["instance_params"]["lower_case"] = True  # as prepare writes it
    path.write_text(json.dumps(values))
    assert verify_dataset(str(tmp_path / "data")).problems == []
    values["tokenizer"]["lower_case"] = False
    path.write_text(json.dumps(values))
    assert verify_dataset(str(tmp_path / "data")).problems == [
        f"{path}: tokenizer.lower_case is False but instance_params.lower_case True (edited?): "
        "the shards were tokenized with one of them; restore it, or prepare the dataset again"]
