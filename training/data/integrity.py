"""Every record batch of a shard checked the first time the loader reads from it, vectorised.

A flipped byte in a shard can make a token id past the vocabulary (an IndexError deep in the
embedding, naming nothing), a length past max_seq_length, or a num_a_tokens that points
between two words. The loader checks each record batch of a shard (a `Segment`: Arrow's list
offsets, flat token ids, num_a_tokens and labels as zero-copy numpy views) before it serves
the first row from it, once per process: a few numpy passes over the flat arrays at memory
speed, so every row is checked before it reaches the model, and a batch pays only for the
record batches nobody has read yet. A failure names the file, the row and what is wrong.

The checks themselves (what a valid row is) live in `pipelines.contract.rows`, shared with
`bertforge inspect --verify`, so a shard that passes --verify passes here too.
"""

from __future__ import annotations

from bertforge.pipelines.contract.rows import (
    MIN_ROW_LENGTH,
    FlatRows,
    RowRules,
    first_bad_row,
    row_problems,
)
from bertforge.training.errors import UserInputError

__all__ = ["MIN_ROW_LENGTH", "CorruptRowError", "FlatRows", "RowRules", "check_rows",
           "row_problems"]


class CorruptRowError(UserInputError):
    """A row of a shard breaks the data contract: the file is damaged or was not made by us."""


def check_rows(rows: FlatRows, rules: RowRules, path: str, first_row: int = 0) -> None:
    """Raise CorruptRowError naming `path` and the first bad row (counted from `first_row`)."""
    found = first_bad_row(rows, rules)
    if found is not None:
        raise CorruptRowError(
            f"shard {path} row {first_row + found.index} is corrupt: {'; '.join(found.reasons)} "
            f"({found.num_bad} bad row(s) in its record batch); check the dataset with "
            "`bertforge inspect --verify`"
        )
