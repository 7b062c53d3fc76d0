"""DatasetFacts: the data's facts read once from the manifest, and the defaults they decide."""

from __future__ import annotations

import pytest

from bertforge.pipelines.contract import manifest as manifest_lib
from bertforge.training.data import MaskingOptions, PretrainingLoader
from bertforge.training.dataset_facts import DatasetFacts
from tests.training.conftest import google_layout_vocab, write_dataset


@pytest.mark.parametrize(("max_seq_length", "max_predictions"), [(128, 20), (512, 80), (64, 10)])
def test_facts_and_google_max_predictions_follow_the_data(tmp_path, max_seq_length,
                                                          max_predictions):
    data = write_dataset(str(tmp_path), {"train": [8]}, max_seq_length=max_seq_length)
    facts = DatasetFacts.read(data)
    manifest = manifest_lib.read_manifest(data)
    assert facts == DatasetFacts(max_seq_length, len(google_layout_vocab()),
                                 manifest.tokenizer.vocab_sha256, True)
    assert facts.default_max_predictions() == max_predictions  # 64 x 0.15 = 9.6 -> 10
    # The loader takes the same facts and, unless told otherwise, the same default.
    loader = PretrainingLoader(data, batch_size=4, seed=0)
    assert loader.facts == facts
    assert loader.collator.masking.max_predictions == max_predictions
    told = PretrainingLoader(data, batch_size=4, seed=0, masking=MaskingOptions(7))
    assert told.collator.masking.max_predictions == 7


def test_masking_options_take_the_default_only_when_unset():
    facts = DatasetFacts(128, 100, "0" * 64, True)
    assert MaskingOptions().for_dataset(facts).max_predictions == 20
    assert MaskingOptions(mask_prob=0.2).for_dataset(facts).max_predictions == 26
    assert MaskingOptions(5).for_dataset(facts) == MaskingOptions(5)
    with pytest.raises(ValueError, match="max_predictions must be >= 1"):
        MaskingOptions(0)


@pytest.mark.parametrize("bad", [None, "128", 0, 12.5])
def test_every_reader_refuses_a_manifest_without_a_valid_max_seq_length(tmp_path, bad):
    """One accessor, one rule: training, `inspect` and `inspect --verify` (which checked a missing
    value three ways and took a wrong one for 512) all name it."""
    from bertforge.pipelines.dataset_stats import inspect_dataset
    from bertforge.pipelines.verify_dataset import verify_dataset
    from bertforge.training.data import PretrainingLoader

    data = write_dataset(str(tmp_path))
    manifest = manifest_lib.read_manifest(data)
    manifest.instance_params.pop("max_seq_length")
    if bad is not None:
        manifest.instance_params["max_seq_length"] = bad
    manifest_lib.write_manifest(data, manifest)
    refusal = f"no valid instance parameter max_seq_length .*found {bad!r}"
    with pytest.raises(ValueError, match=refusal):
        DatasetFacts.read(data)
    with pytest.raises(ValueError, match=refusal):
        PretrainingLoader(data, "train", batch_size=2, seed=1, rank=0, world_size=1)
    with pytest.raises(ValueError, match=refusal):
        inspect_dataset(data)
    problems = verify_dataset(data).problems
    assert any("no valid instance parameter max_seq_length" in p and "rows not checked" in p
               for p in problems), problems
