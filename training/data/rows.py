"""Unmasked rows of one batch, padded: the layout between the shards and the collator.

A batch pads to its own longest row rounded up to a multiple of 8, not to the dataset's
max_seq_length: tensor cores want multiples of 8, and a batch of short rows stays short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAD_MULTIPLE = 8  # tensor cores want sequence lengths in multiples of 8


@dataclass(frozen=True)
class RowBatch:
    """Unmasked rows of one batch: ids padded to a multiple of 8, plus per-row fields."""

    input_ids: np.ndarray  # int64[B, L], [PAD] past each row's length
    lengths: np.ndarray  # int64[B]
    num_a_tokens: np.ndarray  # int64[B], length of [CLS] A [SEP]
    next_sentence_label: np.ndarray  # int64[B]
    sample_indices: np.ndarray  # int64[B], global index in the split: keys the mask


def padded_width(max_length: int, multiple: int = PAD_MULTIPLE) -> int:
    """The longest row rounded up to a multiple of 8 (at least 8)."""
    return max(multiple, -(-max_length // multiple) * multiple)


def rows_from_sequences(
    sequences: Sequence[np.ndarray],
    num_a_tokens: Sequence[int] | np.ndarray,
    next_sentence_label: Sequence[int] | np.ndarray,
    sample_indices: Sequence[int] | np.ndarray,
    pad_id: int,
) -> RowBatch:
    """A `RowBatch` from in-memory id sequences (tests, benchmarks, custom pipelines)."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    input_ids = np.full((len(sequences), padded_width(int(lengths.max(initial=0)))), pad_id)
    real = np.arange(input_ids.shape[1]) < lengths[:, None]
    if len(sequences):
        input_ids[real] = np.concatenate(sequences)  # row-major order matches concatenation
    return RowBatch(
        input_ids=input_ids.astype(np.int64, copy=False),
        lengths=lengths,
        num_a_tokens=np.asarray(num_a_tokens, dtype=np.int64),
        next_sentence_label=np.asarray(next_sentence_label, dtype=np.int64),
        sample_indices=np.asarray(sample_indices, dtype=np.int64),
    )
