from bertforge.pipelines.contract import manifest
from bertforge.pipelines.inspect_shards import format_report, inspect_dataset


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
