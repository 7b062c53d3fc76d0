"""`bertforge inspect --verify`: every file of a prepared dataset against its manifest.

Reads everything once: each shard's sha256, row count, token count and token-id range, and
the vocabulary's sha256 and size. Every problem names its file, so one run lists all the
damage (not just the first), and the command exits non-zero when there is any.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from bertforge.pipelines.contract import manifest


@dataclass
class Verification:
    num_files: int = 0  # shards and vocabulary looked at
    num_bytes: int = 0
    problems: list[str] = field(default_factory=list)  # each names its file

    @property
    def ok(self) -> bool:
        return not self.problems


def read_arrow_file(path: str) -> pa.Table:
    """The whole table of one Arrow IPC file; a file that is not one is named."""
    try:
        with pa.memory_map(path) as source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path} is not a readable Arrow IPC file ({error})") from error


def verify_dataset(data_dir: str) -> Verification:
    """Check every shard and the vocabulary of `data_dir` against its manifest."""
    found = manifest.read_manifest(data_dir)
    result = Verification()
    _verify_vocab(data_dir, found.tokenizer, result)
    for entry in (shard for split in found.splits.values() for shard in split.shards):
        _verify_shard(os.path.join(data_dir, entry.path), entry, found.tokenizer.vocab_size,
                      result)
    return result


def _verify_vocab(data_dir: str, tokenizer: manifest.TokenizerEntry, result: Verification) -> None:
    path = os.path.join(data_dir, manifest.VOCAB_NAME)
    if not _present_and_hashed(path, tokenizer.vocab_sha256, "the manifest's vocabulary", result):
        return
    with open(path, encoding="utf-8") as f:
        size = sum(1 for line in f if line.rstrip("\n"))
    if size != tokenizer.vocab_size:
        result.problems.append(f"{path}: {size} tokens, the manifest says {tokenizer.vocab_size}")


def _verify_shard(path: str, entry: manifest.ShardEntry, vocab_size: int,
                  result: Verification) -> None:
    if not _present_and_hashed(path, entry.sha256, "the manifest lists it", result):
        return
    try:
        table = read_arrow_file(path)
    except ValueError as error:
        result.problems.append(str(error))
        return
    if table.num_rows != entry.num_rows:
        result.problems.append(f"{path}: {table.num_rows} rows, the manifest says "
                               f"{entry.num_rows}")
    if manifest.INPUT_IDS not in table.column_names:
        result.problems.append(f"{path}: no {manifest.INPUT_IDS} column")
        return
    ids = pc.list_flatten(table[manifest.INPUT_IDS])
    if len(ids) != entry.num_tokens:
        result.problems.append(f"{path}: {len(ids)} tokens, the manifest says "
                               f"{entry.num_tokens}")
    largest = pc.max(ids).as_py() if len(ids) else None
    if largest is not None and largest >= vocab_size:
        result.problems.append(f"{path}: token id {largest} outside the vocabulary of "
                               f"{vocab_size}")


def _present_and_hashed(path: str, expected: str, what: str, result: Verification) -> bool:
    """Count the file; note it when missing (False) or when its sha256 is not `expected`."""
    result.num_files += 1
    if not os.path.exists(path):
        result.problems.append(f"{path}: missing ({what})")
        return False
    result.num_bytes += os.path.getsize(path)
    actual = manifest.sha256_file(path)
    if actual != expected:
        result.problems.append(f"{path}: sha256 {actual[:12]}... but the manifest says "
                               f"{expected[:12]}...")
    return True


def format_verification(data_dir: str, result: Verification) -> str:
    if result.ok:
        return (f"verified {data_dir}: {result.num_files} files, {result.num_bytes:,} bytes "
                "match the manifest")
    lines = [f"BAD: {problem}" for problem in result.problems]
    return "\n".join(lines + [f"{len(result.problems)} problem(s) in {data_dir}"])
