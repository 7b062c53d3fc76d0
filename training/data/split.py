"""One split of a prepared dataset, opened and checked against its manifest.

The manifest lists every shard with its row count and sha256, and the vocabulary's hash and
size: a split opens only when the files are the ones the manifest describes, and every error
names the file that is wrong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow.fs as pafs

from bertforge.pipelines.contract import manifest as manifest_lib
from bertforge.pipelines.contract.tokenization import read_vocab
from bertforge.training.data.download import local_dataset_dir
from bertforge.training.data.shards import Segment, ShardRows, open_shard


@dataclass(frozen=True)
class ReadOptions:
    """How a split is read: what is checked on open, and where a remote dataset comes from."""

    # Hash every shard against the manifest on open (reads all the data once).
    verify_checksums: bool = False
    # The model's vocabulary hash: a dataset tokenized with another vocabulary is refused.
    expected_vocab_sha256: str | None = None
    # Where remote datasets are copied (default: the temp directory).
    cache_dir: str | None = None
    # A `pyarrow.fs.FileSystem` that data_dir is a path in, instead of a URI (for stores that
    # need credentials or an endpoint a URI cannot carry).
    filesystem: pafs.FileSystem | None = None


@dataclass(frozen=True)
class OpenedSplit:
    manifest: manifest_lib.Manifest
    rows: ShardRows
    vocab_tokens: list[str]  # vocab.txt in id order


def open_split(data_dir: str, split: str, read: ReadOptions) -> OpenedSplit:
    """A split of a dataset (local, a URI, or a path in `read.filesystem`), checked."""
    local_dir = local_dataset_dir(data_dir, split, read.cache_dir, read.filesystem)
    manifest, rows = open_split_rows(local_dir, split, read.verify_checksums)
    expected = read.expected_vocab_sha256
    if expected is not None and manifest.tokenizer.vocab_sha256 != expected:
        raise ValueError(
            f"the vocabulary of {data_dir} (sha256 {manifest.tokenizer.vocab_sha256[:12]}...) "
            f"does not match the model's ({expected[:12]}...): the token ids "
            "would mean other words; prepare the data with the model's vocab.txt"
        )
    return OpenedSplit(manifest, rows, read_vocab_tokens(local_dir, manifest.tokenizer))


def open_split_rows(
    data_dir: str, split: str, verify_checksums: bool
) -> tuple[manifest_lib.Manifest, ShardRows]:
    """(manifest, rows) of a local dataset directory's split, checked shard by shard."""
    manifest = manifest_lib.read_manifest(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"{data_dir} has no split {split!r} (it has {sorted(manifest.splits)})")
    segments: list[Segment] = []
    for entry in manifest.splits[split].shards:
        path = os.path.join(data_dir, entry.path)
        segments += open_shard(path, entry.num_rows)
        if verify_checksums and manifest_lib.sha256_file(path) != entry.sha256:
            raise ValueError(f"shard {path} does not match its sha256 in the manifest")
    return manifest, ShardRows(segments)


def read_vocab_tokens(data_dir: str, tokenizer: manifest_lib.TokenizerEntry) -> list[str]:
    """vocab.txt in id order, checked against the manifest's hash and size."""
    path = os.path.join(data_dir, manifest_lib.VOCAB_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the dataset's vocabulary is part of it")
    if manifest_lib.sha256_file(path) != tokenizer.vocab_sha256:
        raise ValueError(f"{path} does not match the sha256 recorded in the manifest")
    vocab = read_vocab(path)
    tokens = sorted(vocab, key=vocab.__getitem__)
    if len(tokens) != tokenizer.vocab_size:
        raise ValueError(
            f"{path} has {len(tokens)} tokens, the manifest says {tokenizer.vocab_size}"
        )
    return tokens
