"""Numbers that a refactor must not change (DESIGN.md, "Style" 6), held against recorded values.

The constants below were recorded before the layout change of issue 16 and must not move with a
change that is not meant to change numbers:
- the shards the Beam job writes for a fixed corpus, vocabulary and seed (byte for byte);
- the loader's batches for a fixed dataset and seed (every tensor, exactly);
- the loss curve of a fixed-seed fp32 run through the real DeepSpeed engine (to 1e-4 relative:
  fp32 GEMMs may round differently on another CPU's vector unit; any change of data, masking,
  initialisation or optimizer moves these losses by far more).

A change that *is* meant to change one of them updates the constant in the same commit and says
why in its message.
"""

from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pytest

from tests.training.conftest import google_layout_vocab, write_dataset

# sha256 of each shard file's bytes, by path inside the dataset directory. Re-recorded on
# 2026-11-29: a JSON record's own id is now scoped by its file (`corpus.jsonl:golden-7`, was
# `golden-7`; readers._record_id), so the documents hash into other splits and pools.
EXPECTED_SHARDS = {
    "train/part-00000-of-00002.arrow":
        "b7613cb87e4a06d17c251453a43d9b4edc06d5d6a2768f2c7e753d4f2eb7a98f",
    "train/part-00001-of-00002.arrow":
        "fb65b152b14092c27e5d53cc567d2b678a2f74b533f619c028c601973f5ca0a9",
    "validation/part-00000-of-00001.arrow":
        "cd96585bb37483addf9683906f4feabd5c165072de6aeb494417d0dfe1db12f7",
}
# sha256 over every tensor of the first batches (see `_batches_digest`).
EXPECTED_BATCHES = "122623e7b2c2dcfc657ecc7fab98b5e9601b8bf361acfcd20a58dff3daa0c5bf"
# Total loss at steps 1..6 of `_golden_run`. Re-recorded by issue 11 (fixed-width sparse head):
# the last layer now runs 1 + max_predictions rows per sequence (here 1 + 10) instead of 1 + the
# batch's most labels, so its dropout draws masks of another shape and the random stream moves
# on from there. The math is unchanged: with dropout 0 the old and new curves are bitwise equal
# (6.269112586975098, 6.2716755867004395, 6.2864089012146, ...), and
# tests/training/test_host_sync.py holds the fixed-width head to the exact one.
EXPECTED_LOSSES = [6.271517276763916, 6.281219482421875, 6.287517547607422,
                   6.259495735168457, 6.234986305236816, 6.258708953857422]


def _golden_corpus(path: str) -> None:
    """60 documents of 3-12 sentences over the test vocabulary's words, plus unknown words.

    Built from `random.Random(seed)`, whose integer draws are stable across Python versions.
    """
    rng = random.Random(2024)
    words = [f"word{i}" for i in range(120)] + ["zebra", "quokka"]  # two [UNK]s
    with open(path, "w", encoding="utf-8") as f:
        for doc in range(60):
            sentences = []
            for _ in range(rng.randint(3, 12)):
                sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 18)))
                sentences.append(sentence[0].upper() + sentence[1:] + ".")
            f.write(json.dumps({"doc_id": f"golden-{doc}", "text": " ".join(sentences)}) + "\n")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.slow
def test_prepared_shards_are_byte_identical_to_the_recorded_ones(tmp_path):
    from bertforge.pipelines.prepare import run
    from bertforge.pipelines.prepare_options import PrepareConfig

    corpus = tmp_path / "corpus.jsonl"
    _golden_corpus(str(corpus))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(google_layout_vocab()) + "\n", encoding="utf-8")
    output = tmp_path / "shards"
    run(PrepareConfig(inputs=(str(corpus),), output=str(output), vocab=str(vocab),
                      max_seq_length=48, dupe_factor=2, num_shards=2, seed=99,
                      validation_fraction=0.2))
    shards = {
        os.path.relpath(os.path.join(d, name), output): _sha256(os.path.join(d, name))
        for d, _, names in os.walk(output) for name in names if name.endswith(".arrow")
    }
    assert shards == EXPECTED_SHARDS


def _batches_digest(batches) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            tensor = batch[name]
            digest.update(name.encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().astype(np.int64).tobytes())
    return digest.hexdigest()


def test_loader_batches_are_identical_to_the_recorded_ones(tmp_path):
    from bertforge.training.data import MaskingOptions, PretrainingLoader

    data = write_dataset(str(tmp_path / "data"), {"train": [40, 33]}, max_seq_length=64, seed=5)
    batches = []
    for whole_word in (False, True):
        masking = MaskingOptions(whole_word=whole_word)
        loader = PretrainingLoader(data, batch_size=6, seed=11, masking=masking, prefetch=0)
        loader.set_epoch(1)
        batches += list(loader)
    assert _batches_digest(batches) == EXPECTED_BATCHES


def _golden_run(data_dir: str, run_dir: str):
    from bertforge.training.config import TrainConfig
    from bertforge.training.loop import train

    cfg = TrainConfig(
        data_dir=data_dir, run_dir=run_dir, max_steps=6, micro_batch_size=8, warmup_steps=2,
        learning_rate=1e-3, log_every=1, zero_stage=0, precision="fp32", seed=21,
        model={"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2,
               "intermediate_size": 64},
    )
    return train(cfg)


@pytest.mark.slow
def test_fixed_seed_loss_curve_is_the_recorded_one(tmp_path):
    from bertforge.training.metrics import read_metrics

    data = write_dataset(str(tmp_path / "data"), {"train": [70, 60]}, max_seq_length=64, seed=8)
    _golden_run(data, str(tmp_path / "run"))
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "run")) if "loss" in r]
    assert losses == pytest.approx(EXPECTED_LOSSES, rel=1e-4)
