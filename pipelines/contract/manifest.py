"""The shard-directory contract: `manifest.json`, its splits and shard entries.

A prepared dataset is one directory:

    manifest.json                       written last: a directory without it is incomplete
    vocab.txt                           the vocabulary the ids refer to
    train/part-00000-of-00004.arrow     Arrow IPC files, one row per sentence-pair instance
    validation/part-00000-of-00001.arrow
    rejects.jsonl                       every rejected input or record, with its reason

This module is deliberately free of Beam and torch: the training loader reads manifests too.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
VOCAB_NAME = "vocab.txt"
REJECTS_NAME = "rejects.jsonl"
SPLITS = ("train", "validation")

# Column names and types of every shard (DESIGN.md, "Shards").
INPUT_IDS = "input_ids"
NUM_A_TOKENS = "num_a_tokens"
NEXT_SENTENCE_LABEL = "next_sentence_label"
DOC_ID = "doc_id"


def shard_schema(vocab_size: int) -> pa.Schema:
    """uint16 ids halve the shard size; a vocabulary past 65,535 entries needs int32."""
    id_type = pa.uint16() if vocab_size <= 65_535 else pa.int32()
    return pa.schema(
        [
            pa.field(INPUT_IDS, pa.list_(id_type), nullable=False),
            pa.field(NUM_A_TOKENS, pa.uint16(), nullable=False),
            pa.field(NEXT_SENTENCE_LABEL, pa.int8(), nullable=False),
            pa.field(DOC_ID, pa.string(), nullable=False),
        ]
    )


def shard_file_name(split: str, index: int, num_shards: int) -> str:
    """Relative path of one shard, e.g. `train/part-00003-of-00008.arrow`."""
    return f"{split}/part-{index:05d}-of-{num_shards:05d}.arrow"


def unlisted_shard_files(data_dir: str, found: Manifest) -> list[str]:
    """Shard-named files of a local dataset that its manifest does not list (relative paths,
    sorted): what an earlier dataset of other shard counts left in the directory. A reader
    globbing `train/*.arrow` would read them beside the dataset's own."""
    listed = {shard.path for split in found.splits.values() for shard in split.shards}
    on_disk = (f"{split}/{name}" for split in SPLITS
               if os.path.isdir(os.path.join(data_dir, split))
               for name in os.listdir(os.path.join(data_dir, split))
               if fnmatch.fnmatch(name, "part-?????-of-?????.arrow"))
    return sorted(path for path in on_disk if path not in listed)


def is_bertforge_dataset(folder: str) -> bool:
    """Whether a local folder holds a manifest that bertforge wrote (finished or being read)."""
    try:
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            return json.load(f).get("created_by") == "bertforge"
    except (OSError, ValueError, AttributeError):
        return False


def missing_shard_files(data_dir: str, found: Manifest) -> list[str]:
    """The shards a local dataset's manifest lists that are not on disk (relative paths)."""
    return [shard.path for split in found.splits.values() for shard in split.shards
            if not os.path.isfile(os.path.join(data_dir, shard.path))]


def finished_dataset(data_dir: str) -> bool:
    """A local dataset whose readable manifest (written last) lists only shards on disk: what
    `prepare` and the pipeline's prepare stage count as done, with nothing left to make."""
    try:
        return not missing_shard_files(data_dir, read_manifest(data_dir))
    except (ValueError, KeyError, OSError):  # no manifest, or a damaged one
        return False


@dataclass
class ShardEntry:
    path: str  # relative to the dataset directory
    num_rows: int
    num_tokens: int
    sha256: str


@dataclass
class SplitEntry:
    num_instances: int
    num_tokens: int
    num_documents: int
    shards: list[ShardEntry]


@dataclass
class TokenizerEntry:
    vocab_sha256: str
    vocab_size: int
    lower_case: bool


@dataclass
class Manifest:
    tokenizer: TokenizerEntry
    instance_params: dict[str, Any]
    splits: dict[str, SplitEntry]
    counts: dict[str, Any]  # documents, sentences, instances, rejected: {reason: n}
    format_version: int = FORMAT_VERSION
    created_by: str = "bertforge"
    extra: dict[str, Any] = field(default_factory=dict)
    # Every input file read: {path: {"format": "wiki", "chosen_by": "prefix"|"name"|"content",
    # "bytes": its size}}. Absent from manifests written before it existed (read back as {}),
    # "bytes" from those written before 2026-11-27.
    input_files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def split_sha256(self, name: str) -> str | None:
        """One digest of a split's samples in the order readers number them (its shards' own
        digests and row counts, in the manifest's order; not their paths, so a moved or copied
        dataset keeps it); None for a split the dataset lacks."""
        split = self.splits.get(name)
        if split is None:
            return None
        listed = "".join(f"{shard.sha256} {shard.num_rows}\n" for shard in split.shards)
        return hashlib.sha256(listed.encode()).hexdigest()

    def instance_param(self, name: str, where: str = "the dataset") -> int:
        """An instance parameter readers rely on (`max_seq_length`), read by the one rule every
        reader follows: missing, or not a positive integer, is a ValueError naming it."""
        value = self.instance_params.get(name)
        if type(value) is not int or value < 1:
            raise ValueError(
                f"the manifest of {where} has no valid instance parameter {name} (a positive "
                f"integer; found {value!r}): not a dataset prepared by bertforge")
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"unsupported shard format_version {data.get('format_version')!r} "
                f"(this bertforge reads {FORMAT_VERSION})"
            )
        splits = {
            name: SplitEntry(
                num_instances=s["num_instances"],
                num_tokens=s["num_tokens"],
                num_documents=s["num_documents"],
                shards=[ShardEntry(**e) for e in s["shards"]],
            )
            for name, s in data["splits"].items()
        }
        return cls(
            tokenizer=TokenizerEntry(**data["tokenizer"]),
            instance_params=data["instance_params"],
            splits=splits,
            counts=data["counts"],
            format_version=data["format_version"],
            created_by=data.get("created_by", "bertforge"),
            extra=data.get("extra", {}),
            input_files=data.get("input_files", {}),
        )


def read_manifest(data_dir: str) -> Manifest:
    """Read and parse `DIR/manifest.json`; a clear error when the directory is incomplete."""
    path = os.path.join(data_dir, MANIFEST_NAME)
    # Not "afile/manifest.json not found". A FileNotFoundError, as a missing manifest: every
    # caller takes that one for "no dataset there" (a user error, not retried).
    if os.path.isfile(data_dir):
        raise FileNotFoundError(f"{data_dir} is a file, not a prepared dataset (a directory "
                                f"holding {MANIFEST_NAME} and its shards)")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: {data_dir} is not a prepared dataset, or its preparation "
            "did not finish (the manifest is written last)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            return Manifest.from_dict(json.load(f))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors; a missing key or a value of
        # the wrong shape is a KeyError/TypeError: all say "this file is not a manifest".
        what = f"missing key {error}" if isinstance(error, KeyError) else str(error)
        raise ValueError(f"{path} is not a valid bertforge manifest ({what})") from error


def write_manifest(data_dir: str, manifest: Manifest) -> str:
    """Write atomically (temp file + rename) so a reader never sees half a manifest."""
    path = os.path.join(data_dir, MANIFEST_NAME)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # two writers (two runs' copies) never share one
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())  # an empty manifest after a power loss is no dataset's
    os.replace(tmp, path)
    return path


def sha256_file(path: str, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
