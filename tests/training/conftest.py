"""Shard-directory fixtures for the loader and masking tests: small, but laid out for real."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from bertforge.pipelines.contract import manifest as manifest_lib

NUM_WORDS = 120
NUM_PIECES = 40


def google_layout_vocab() -> list[str]:
    """Google's layout: [PAD] 0, [unused0..98] 1..99, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103.

    Ids deliberately not 0..4, so nothing may hard-code them.
    """
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)]
    tokens += ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += [f"word{i}" for i in range(NUM_WORDS)] + [f"##p{i}" for i in range(NUM_PIECES)]
    return tokens


def random_rows(rng: np.random.Generator, num_rows: int, max_seq_length: int, vocab: list[str]):
    """Rows shaped like the pipeline's: [CLS] A [SEP] B [SEP], words and ## pieces mixed."""
    index = {t: i for i, t in enumerate(vocab)}
    words = np.array([index[f"word{i}"] for i in range(NUM_WORDS)])
    pieces = np.array([index[f"##p{i}"] for i in range(NUM_PIECES)])
    rows = []
    for _ in range(num_rows):
        total = int(rng.integers(8, max_seq_length - 3, endpoint=True))
        len_a = int(rng.integers(1, total - 1))
        body = np.where(
            rng.random(total) < 0.3, rng.choice(pieces, total), rng.choice(words, total)
        )
        body[0] = body[len_a] = rng.choice(words)  # segments start with a word
        ids = np.concatenate(
            [[index["[CLS]"]], body[:len_a], [index["[SEP]"]], body[len_a:], [index["[SEP]"]]]
        )
        rows.append((ids.astype(np.uint16), len_a + 2, int(rng.integers(0, 2))))
    return rows


def write_shard(path: str, rows, schema: pa.Schema, rows_per_batch: int = 7) -> None:
    """Several record batches per file, as a streaming writer produces them."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, len(rows), rows_per_batch):
            part = rows[start : start + rows_per_batch]
            writer.write_batch(
                pa.record_batch(
                    [
                        pa.array([r[0] for r in part], schema.field(0).type),
                        pa.array([r[1] for r in part], pa.uint16()),
                        pa.array([r[2] for r in part], pa.int8()),
                        pa.array([f"doc-{start + i}" for i in range(len(part))], pa.string()),
                    ],
                    schema=schema,
                )
            )


def write_dataset(
    root: str,
    shard_rows: dict[str, list[int]] | None = None,
    *,
    max_seq_length: int = 64,
    seed: int = 0,
) -> str:
    """A complete prepared dataset: vocab.txt, shards per split, manifest with real hashes."""
    shard_rows = shard_rows or {"train": [23, 17, 30], "validation": [13]}
    vocab = google_layout_vocab()
    os.makedirs(root, exist_ok=True)
    vocab_path = os.path.join(root, manifest_lib.VOCAB_NAME)
    with open(vocab_path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    schema = manifest_lib.shard_schema(len(vocab))
    rng = np.random.default_rng(seed)
    splits = {}
    for split, sizes in shard_rows.items():
        entries = []
        for i, num_rows in enumerate(sizes):
            rows = random_rows(rng, num_rows, max_seq_length, vocab)
            relative = manifest_lib.shard_file_name(split, i, len(sizes))
            write_shard(os.path.join(root, relative), rows, schema)
            entries.append(
                manifest_lib.ShardEntry(
                    path=relative,
                    num_rows=num_rows,
                    num_tokens=sum(len(r[0]) for r in rows),
                    sha256=manifest_lib.sha256_file(os.path.join(root, relative)),
                )
            )
        splits[split] = manifest_lib.SplitEntry(
            num_instances=sum(sizes),
            num_tokens=sum(e.num_tokens for e in entries),
            num_documents=sum(sizes),
            shards=entries,
        )
    manifest = manifest_lib.Manifest(
        tokenizer=manifest_lib.TokenizerEntry(
            vocab_sha256=manifest_lib.sha256_file(vocab_path),
            vocab_size=len(vocab),
            lower_case=True,
        ),
        instance_params={"max_seq_length": max_seq_length, "short_seq_prob": 0.1, "seed": seed},
        splits=splits,
        counts={"documents": 0, "sentences": 0, "instances": 0, "rejected": {}},
    )
    manifest_lib.write_manifest(root, manifest)
    return root


def read_split_rows(data_dir: str, split: str) -> list[tuple[np.ndarray, int, int]]:
    """Every row of a split in manifest order, read plainly (the tests' ground truth)."""
    manifest = manifest_lib.read_manifest(data_dir)
    rows = []
    for entry in manifest.splits[split].shards:
        table = pa.ipc.open_file(os.path.join(data_dir, entry.path)).read_all()
        for ids, num_a, label in zip(
            table.column("input_ids").to_pylist(),
            table.column("num_a_tokens").to_pylist(),
            table.column("next_sentence_label").to_pylist(),
            strict=True,
        ):
            rows.append((np.array(ids), num_a, label))
    return rows


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    """Read-only shared dataset: 70 train rows in 3 shards, 13 validation rows."""
    return write_dataset(str(tmp_path_factory.mktemp("dataset")))


def reference_and_resumed(data_dir: str, options: dict, epoch: int, num_batches: int):
    """(every batch of an uninterrupted epoch, a loader resumed after `num_batches` of it)."""
    from bertforge.training.data import PretrainingLoader

    reference = PretrainingLoader(data_dir, **options)
    reference.set_epoch(epoch)
    want = list(reference)
    interrupted = PretrainingLoader(data_dir, **options)
    interrupted.set_epoch(epoch)
    iterator = iter(interrupted)
    for _ in range(num_batches):
        next(iterator)
    resumed = PretrainingLoader(data_dir, **options)
    resumed.load_state_dict(interrupted.state_dict())
    return want, resumed
