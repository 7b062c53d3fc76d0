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
from bertforge.training.data.checksums import ChecksumCheck, verify_in_background
from bertforge.training.data.download import local_dataset_dir
from bertforge.training.data.integrity import RowRules
from bertforge.training.data.mapped_shards import Segment, ShardRows, open_shard
from bertforge.training.errors import MissingInputError, UserInputError, as_user_error


@dataclass(frozen=True)
class ReadOptions:
    """How a split is read: what is checked on open, and where a remote dataset comes from."""

    # Hash every shard against the manifest once per process, in a background thread (see
    # `training.data.checksums`): a mismatch fails the next batch. Rows are validated as they
    # are read either way (`training.data.integrity`).
    verify_checksums: bool = True
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
    rules: RowRules  # what every row read must satisfy
    checksums: ChecksumCheck | None  # None: verification opted out


def open_split(data_dir: str, split: str, read: ReadOptions) -> OpenedSplit:
    """A split of a dataset (local, a URI, or a path in `read.filesystem`), checked."""
    local_dir = local_dataset_dir(data_dir, split, read.cache_dir, read.filesystem)
    manifest, rows = open_split_rows(local_dir, split)
    expected = read.expected_vocab_sha256
    if expected is not None and manifest.tokenizer.vocab_sha256 != expected:
        raise UserInputError(
            f"the vocabulary of {data_dir} (sha256 {manifest.tokenizer.vocab_sha256[:12]}...) "
            f"does not match the model's ({expected[:12]}...): the token ids "
            "would mean other words; prepare the data with the model's vocab.txt"
        )
    tokens = read_vocab_tokens(local_dir, manifest.tokenizer)
    try:
        max_seq_length = manifest.instance_param("max_seq_length", data_dir)
    except ValueError as error:
        raise UserInputError(str(error)) from error
    checksums = None
    if read.verify_checksums:
        checksums = verify_in_background([
            (os.path.join(local_dir, entry.path), entry.sha256)
            for entry in manifest.splits[split].shards
        ])
    return OpenedSplit(manifest, rows, tokens, RowRules.from_vocab(tokens, max_seq_length),
                       checksums)


def read_dataset_manifest(data_dir: str) -> manifest_lib.Manifest:
    """The manifest of a local dataset; a missing or malformed one is a user error."""
    try:
        return manifest_lib.read_manifest(data_dir)
    except (ValueError, FileNotFoundError) as error:
        raise as_user_error(error) from error


def open_split_rows(data_dir: str, split: str) -> tuple[manifest_lib.Manifest, ShardRows]:
    """(manifest, rows) of a local dataset directory's split, checked shard by shard."""
    manifest = read_dataset_manifest(data_dir)
    return manifest, split_rows(data_dir, manifest, split)


def split_rows(data_dir: str, manifest: manifest_lib.Manifest, split: str) -> ShardRows:
    """The rows of `split` of a local dataset whose manifest is parsed already, checked shard
    by shard (footers and row counts, memory-mapped)."""
    if split not in manifest.splits:
        raise UserInputError(
            f"{data_dir} has no split {split!r} (it has {sorted(manifest.splits)})")
    segments: list[Segment] = []
    for entry in manifest.splits[split].shards:
        segments += open_shard(os.path.join(data_dir, entry.path), entry.num_rows)
    return ShardRows(segments)


def read_vocab_tokens(data_dir: str, tokenizer: manifest_lib.TokenizerEntry) -> list[str]:
    """vocab.txt in id order, checked against the manifest's hash and size."""
    path = os.path.join(data_dir, manifest_lib.VOCAB_NAME)
    if not os.path.exists(path):
        raise MissingInputError(f"{path} is missing: the dataset's vocabulary is part of it")
    if manifest_lib.sha256_file(path) != tokenizer.vocab_sha256:
        raise UserInputError(f"{path} does not match the sha256 recorded in the manifest")
    vocab = read_vocab(path)
    tokens = sorted(vocab, key=vocab.__getitem__)
    if len(tokens) != tokenizer.vocab_size:
        raise UserInputError(
            f"{path} has {len(tokens)} tokens, the manifest says {tokenizer.vocab_size}"
        )
    return tokens
