"""The rows of a shard checked against the data contract: one vectorised implementation.

Shared by the loader (`training.data.integrity`, each record batch before its first row is
served), `bertforge inspect --verify` (`pipelines.verify_dataset`, every record batch) and
`bertforge inspect` (`pipelines.dataset_stats`), so a shard that passes --verify cannot fail
training with a corrupt row. numpy and pyarrow only: no Beam, no torch.

A row is valid when: every id is in [0, vocab_size); 5 <= length <= max_seq_length
([CLS] A [SEP] B [SEP], A and B at least one token each); ids[0] is [CLS];
3 <= num_a_tokens <= length - 2 with [SEP] at num_a_tokens - 1 and at length - 1; and
next_sentence_label is 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from bertforge.pipelines.contract import manifest

MIN_ROW_LENGTH = 5  # [CLS] a [SEP] b [SEP]


@dataclass(frozen=True)
class RowRules:
    """What a valid row of one dataset looks like (from its manifest and vocabulary)."""

    vocab_size: int
    max_seq_length: int
    cls_id: int
    sep_id: int

    @classmethod
    def from_vocab(cls, vocab_tokens: list[str], max_seq_length: int,
                   vocab_size: int | None = None) -> RowRules:
        """`vocab_size`: the manifest's, when it is to be trusted over the file's length."""
        return cls(len(vocab_tokens) if vocab_size is None else vocab_size, max_seq_length,
                   vocab_tokens.index("[CLS]"), vocab_tokens.index("[SEP]"))


@dataclass(frozen=True)
class FlatRows:
    """Rows as Arrow lays out a list column: row i is values[offsets[i]:offsets[i + 1]]."""

    offsets: np.ndarray  # num_rows + 1
    values: np.ndarray  # token ids
    num_a_tokens: np.ndarray
    next_sentence_label: np.ndarray


def row_problems(rows: FlatRows, rules: RowRules) -> tuple[np.ndarray, list[str]]:
    """(bad, reasons): a boolean per row and, for the first bad row, what is wrong with it.

    A range is one unsigned comparison (below its low end, x - low wraps to a huge number);
    the checks are named one by one only once a row has failed.
    """
    checks = _checks(rows, rules)
    bad = checks["length"] | checks["num_a"] | checks["label"] | checks["specials"]
    tokens = rows.values[rows.offsets[0]:rows.offsets[-1]] if len(rows.offsets) else rows.values
    ids_in_range = not len(tokens) or (
        int(tokens.max()) < rules.vocab_size and (tokens.dtype.kind == "u" or tokens.min() >= 0))
    if ids_in_range and not np.count_nonzero(bad):
        return bad, []
    if not ids_in_range:
        checks["id"] = _rows_with_bad_ids(rows, tokens, rules)
        bad = bad | checks["id"]
    first = int(np.flatnonzero(bad)[0])
    reasons = _describe(rows, rules, first, checks)
    return bad, reasons or ["[CLS]/[SEP] are not where num_a_tokens and the length put them"]


def _checks(rows: FlatRows, rules: RowRules) -> dict[str, np.ndarray]:
    """Per-row failures of each check but the ids' range."""
    u64 = np.uint64
    starts = rows.offsets[:-1].astype(np.int64)
    ends = rows.offsets[1:].astype(np.int64)
    spare = (ends - starts - MIN_ROW_LENGTH).view(u64)  # length - 5: >= 0 when valid
    num_a = rows.num_a_tokens.astype(np.int64)
    # 'clip' keeps a position from a broken offset or num_a inside the array: that row fails
    # its range check anyway.
    at = lambda positions: np.take(rows.values, positions, mode="clip")  # noqa: E731
    return {
        "length": spare > u64(rules.max_seq_length - MIN_ROW_LENGTH),
        "num_a": (num_a - 3).view(u64) > spare,  # 3 <= num_a <= length - 2
        "label": rows.next_sentence_label.astype(np.int64).view(u64) > u64(1),
        "specials": ((at(starts) != rules.cls_id) | (at(starts + num_a - 1) != rules.sep_id)
                     | (at(ends - 1) != rules.sep_id)),
    }


def _rows_with_bad_ids(rows: FlatRows, tokens: np.ndarray, rules: RowRules) -> np.ndarray:
    """Rows holding an id outside [0, vocab_size) (the slow path, after one has been seen)."""
    wrong = np.flatnonzero((tokens >= rules.vocab_size) | (tokens < 0)) + int(rows.offsets[0])
    bad = np.zeros(len(rows.offsets) - 1, dtype=bool)
    bad[np.searchsorted(rows.offsets[1:], wrong, side="right")] = True
    return bad


def _describe(rows: FlatRows, rules: RowRules, i: int, checks: dict[str, np.ndarray]
              ) -> list[str]:
    start, end = int(rows.offsets[i]), int(rows.offsets[i + 1])
    length, num_a = end - start, int(rows.num_a_tokens[i])
    reasons = []
    if "id" in checks and checks["id"][i]:
        ids = rows.values[start:end]
        out = ids[(ids >= rules.vocab_size) | (ids < 0)]
        reasons.append(f"token id {int(out[0])} outside the vocabulary of {rules.vocab_size}")
    if checks["length"][i]:
        reasons.append(f"length {length} outside [{MIN_ROW_LENGTH}, {rules.max_seq_length}]")
    if checks["num_a"][i]:
        reasons.append(f"num_a_tokens {num_a} outside [3, length - 2 = {length - 2}]")
    if checks["label"][i]:
        reasons.append(f"next_sentence_label {int(rows.next_sentence_label[i])} not 0 or 1")
    return reasons


class BadRow(NamedTuple):
    index: int  # within the rows checked
    reasons: list[str]
    num_bad: int  # bad rows among those checked


def first_bad_row(rows: FlatRows, rules: RowRules) -> BadRow | None:
    """The first row that breaks the contract, what is wrong with it, and how many do; None
    when every row is valid."""
    bad, reasons = row_problems(rows, rules)
    if not reasons:
        return None
    return BadRow(int(np.flatnonzero(bad)[0]), reasons, int(bad.sum()))


def batch_rows(batch: pa.RecordBatch) -> FlatRows:
    """A shard's record batch as `FlatRows` (zero-copy where Arrow's layout allows)."""
    ids = batch.column(manifest.INPUT_IDS)
    return FlatRows(
        offsets=ids.offsets.to_numpy(),
        values=ids.values.to_numpy(zero_copy_only=False),
        num_a_tokens=batch.column(manifest.NUM_A_TOKENS).to_numpy(zero_copy_only=False),
        next_sentence_label=batch.column(manifest.NEXT_SENTENCE_LABEL).to_numpy(
            zero_copy_only=False),
    )


def table_problem(table: pa.Table, rules: RowRules, path: str) -> str | None:
    """The first broken row of a whole shard, named by file and row, or None."""
    first_row = 0
    for batch in table.to_batches():
        found = first_bad_row(batch_rows(batch), rules) if batch.num_rows else None
        if found is not None:
            return (f"{path}: {'; '.join(found.reasons)} in row {first_row + found.index} "
                    f"({found.num_bad} bad row(s) in its record batch of {batch.num_rows})")
        first_row += batch.num_rows
    return None
