"""Every row checked as it is read: token ids, length, segments and label, vectorised.

A flipped byte in a shard can make a token id past the vocabulary (an IndexError deep in the
embedding, naming nothing), a length past max_seq_length, or a num_a_tokens that points
between two words. Rows are checked in the batch that gathers them, so the cost follows the
data actually read (a few numpy passes over ids the collator copies anyway) and no row
reaches the model unchecked; a failure names the file, the row and what is wrong.

A row is valid when: every id is in [0, vocab_size); 5 <= length <= max_seq_length
([CLS] A [SEP] B [SEP], A and B at least one token each); ids[0] is [CLS];
3 <= num_a_tokens <= length - 2 with [SEP] at num_a_tokens - 1 and at length - 1; and
next_sentence_label is 0 or 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bertforge.training.data.rows import RowBatch
from bertforge.training.errors import UserInputError

MIN_ROW_LENGTH = 5  # [CLS] a [SEP] b [SEP]


@dataclass(frozen=True)
class RowRules:
    """What a valid row of one dataset looks like (from its manifest and vocabulary)."""

    vocab_size: int
    max_seq_length: int
    cls_id: int
    sep_id: int

    @classmethod
    def from_vocab(cls, vocab_tokens: list[str], max_seq_length: int) -> RowRules:
        return cls(len(vocab_tokens), max_seq_length,
                   vocab_tokens.index("[CLS]"), vocab_tokens.index("[SEP]"))


class CorruptRowError(UserInputError):
    """A row of a shard breaks the data contract: the file is damaged or was not made by us."""


def row_problems(rows: RowBatch, rules: RowRules) -> tuple[np.ndarray, list[str]]:
    """(bad, reasons): a boolean per row and, for the first bad row, what is wrong with it."""
    ids, lengths, num_a = rows.input_ids, rows.lengths, rows.num_a_tokens
    count = len(lengths)
    bad_length = (lengths < MIN_ROW_LENGTH) | (lengths > rules.max_seq_length)
    bad_num_a = (num_a < 3) | (num_a > lengths - 2)
    bad_label = (rows.next_sentence_label != 0) & (rows.next_sentence_label != 1)
    # One pass for the common case; the per-row scan only when some id is out of range.
    if count and (int(ids.max()) >= rules.vocab_size or int(ids.min()) < 0):
        bad_id = ((ids >= rules.vocab_size) | (ids < 0)).any(axis=1)
    else:
        bad_id = np.zeros(count, dtype=bool)
    width = ids.shape[1] if ids.ndim == 2 else 0
    at = np.arange(count)
    if width:  # clipped positions: rows with a bad length or num_a are flagged above anyway
        sep_a = ids[at, np.clip(num_a - 1, 0, width - 1)]
        sep_end = ids[at, np.clip(lengths - 1, 0, width - 1)]
        bad_specials = (ids[:, 0] != rules.cls_id) | (sep_a != rules.sep_id) | (
            sep_end != rules.sep_id)
    else:
        bad_specials = np.zeros(count, dtype=bool)
    bad = bad_length | bad_num_a | bad_label | bad_id | bad_specials
    if not bad.any():
        return bad, []
    first = int(np.flatnonzero(bad)[0])
    reasons = _describe(rows, rules, first, bad_length, bad_num_a, bad_label, bad_id)
    return bad, reasons or ["[CLS]/[SEP] are not where num_a_tokens and the length put them"]


def _describe(rows: RowBatch, rules: RowRules, i: int, bad_length, bad_num_a, bad_label,
              bad_id) -> list[str]:
    length, num_a = int(rows.lengths[i]), int(rows.num_a_tokens[i])
    reasons = []
    if bad_id[i]:
        row_ids = rows.input_ids[i, :length]
        out = row_ids[(row_ids >= rules.vocab_size) | (row_ids < 0)]
        reasons.append(f"token id {int(out[0])} outside the vocabulary of {rules.vocab_size}")
    if bad_length[i]:
        reasons.append(f"length {length} outside [{MIN_ROW_LENGTH}, {rules.max_seq_length}]")
    if bad_num_a[i]:
        reasons.append(f"num_a_tokens {num_a} outside [3, length - 2 = {length - 2}]")
    if bad_label[i]:
        reasons.append(f"next_sentence_label {int(rows.next_sentence_label[i])} not 0 or 1")
    return reasons


def check_rows(rows: RowBatch, rules: RowRules, locate: Callable[[int], str]) -> None:
    """Raise CorruptRowError naming the first bad row (`locate`: global index -> 'file row n')."""
    bad, reasons = row_problems(rows, rules)
    if reasons:
        where = locate(int(rows.sample_indices[int(np.flatnonzero(bad)[0])]))
        raise CorruptRowError(
            f"{where} is corrupt: {'; '.join(reasons)} ({int(bad.sum())} bad row(s) in this "
            "batch); check the dataset with `bertforge inspect --verify`"
        )
