"""`bertforge inspect --verify`: every file of a prepared dataset against its manifest.

Reads everything once: each shard's sha256, row count and token count, every row against the
data contract (the same checks the training loader makes, `contract.rows`: ids in the
vocabulary, lengths, [CLS]/[SEP] placement, num_a_tokens, NSP label), and the vocabulary's
sha256 and size. Every problem names its file (and row), so one run lists all the damage (not
just the first), and the command exits non-zero when there is any. A shard that passes cannot
fail training with a corrupt row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.contract.rows import RowRules, table_problem
from bertforge.pipelines.contract.tokenization import read_vocab

REQUIRED_COLUMNS = (manifest.INPUT_IDS, manifest.NUM_A_TOKENS, manifest.NEXT_SENTENCE_LABEL)


@dataclass
class Verification:
    num_files: int = 0  # shards and vocabulary looked at
    num_bytes: int = 0
    problems: list[str] = field(default_factory=list)  # each names its file

    @property
    def ok(self) -> bool:
        return not self.problems


def read_arrow_file(path: str) -> pa.Table:
    """The whole table of one Arrow IPC file; a file that is not one, or none, is named."""
    if not os.path.exists(path):  # Arrow's own words: "Failed to open local file ... errno 2"
        raise ValueError(f"{path} is missing (the manifest lists it): copy it back, or "
                         "prepare the dataset again")
    try:
        with pa.memory_map(path) as source:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path} is not a readable Arrow IPC file ({error})") from error


def verify_dataset(data_dir: str) -> Verification:
    """Check every shard and the vocabulary of `data_dir` against its manifest."""
    found = manifest.read_manifest(data_dir)
    result = Verification()
    vocab = _verify_vocab(data_dir, found.tokenizer, result)
    _verify_casing(data_dir, found, result)
    rules = _row_rules(data_dir, found, vocab, result)
    for entry in (shard for split in found.splits.values() for shard in split.shards):
        _verify_shard(os.path.join(data_dir, entry.path), entry, rules, result)
    result.problems += [f"{os.path.join(data_dir, path)}: a shard the manifest does not list "
                        "(left by another dataset?): remove it"
                        for path in manifest.unlisted_shard_files(data_dir, found)]
    return result


def _verify_vocab(data_dir: str, tokenizer: manifest.TokenizerEntry,
                  result: Verification) -> list[str] | None:
    """The vocabulary's tokens in id order, or None when it is missing or unreadable."""
    path = os.path.join(data_dir, manifest.VOCAB_NAME)
    if not _present_and_hashed(path, tokenizer.vocab_sha256, "the manifest's vocabulary", result):
        return None
    try:
        ids = read_vocab(path)
    except (ValueError, UnicodeDecodeError) as error:
        result.problems.append(f"{path}: not a readable vocabulary ({error})")
        return None
    if len(ids) != tokenizer.vocab_size:
        result.problems.append(f"{path}: {len(ids)} tokens, the manifest says "
                               f"{tokenizer.vocab_size}")
    return sorted(ids, key=ids.__getitem__)


def _verify_casing(data_dir: str, found: manifest.Manifest, result: Verification) -> None:
    """The manifest records the casing twice (its tokenizer's, its instance parameters'); an
    edit of one (lower_case flipped by hand) made `train`'s casing checks and the export's
    do_lower_case follow a casing the shards were not tokenized with, and verified clean."""
    recorded = found.instance_params.get("lower_case")
    if isinstance(recorded, bool) and recorded != found.tokenizer.lower_case:
        result.problems.append(
            f"{os.path.join(data_dir, manifest.MANIFEST_NAME)}: tokenizer.lower_case is "
            f"{found.tokenizer.lower_case} but instance_params.lower_case {recorded} (edited?): "
            "the shards were tokenized with one of them; restore it, or prepare the dataset "
            "again")


def _row_rules(data_dir: str, found: manifest.Manifest, vocab: list[str] | None,
               result: Verification) -> RowRules | None:
    """What every row must satisfy, as the training loader sees it; None (and a problem) when
    the dataset cannot say, in which case the rows are not checked."""
    try:
        max_seq_length = found.instance_param("max_seq_length", data_dir)
    except ValueError as error:
        result.problems.append(f"{error}: rows not checked")
        return None
    if vocab is None:
        return None  # already a problem (read_vocab refuses one without [CLS]/[SEP])
    # The manifest's size, as the model's embedding has it, even if vocab.txt disagrees.
    return RowRules.from_vocab(vocab, max_seq_length, found.tokenizer.vocab_size)


def _verify_shard(path: str, entry: manifest.ShardEntry, rules: RowRules | None,
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
    missing = [name for name in REQUIRED_COLUMNS if name not in table.column_names]
    if missing:
        result.problems.append(f"{path}: no {', '.join(missing)} column(s)")
        return
    num_tokens = int(pc.sum(pc.list_value_length(table[manifest.INPUT_IDS])).as_py() or 0)
    if num_tokens != entry.num_tokens:
        result.problems.append(f"{path}: {num_tokens} tokens, the manifest says "
                               f"{entry.num_tokens}")
    if rules is None:
        return
    try:
        problem = table_problem(table, rules, path)
    except (pa.ArrowException, AttributeError, TypeError) as error:
        problem = f"{path}: unexpected column types ({error})"
    if problem:
        result.problems.append(problem)


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
