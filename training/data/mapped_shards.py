"""Memory-mapped Arrow shards: opened and checked one by one, then read by global row index.

A shard is mapped, not read: its record batches become zero-copy numpy views, so memory stays
flat in the dataset size and a row is one seek away. `ShardRows` gathers the rows of one batch
from wherever they live, touching only the pages those rows are on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from bertforge.pipelines.contract import manifest as manifest_lib
from bertforge.training.data.integrity import FlatRows, RowRules, check_rows
from bertforge.training.data.rows import RowBatch, padded_width
from bertforge.training.errors import MissingInputError, UserInputError

REQUIRED_COLUMNS = (
    manifest_lib.INPUT_IDS,
    manifest_lib.NUM_A_TOKENS,
    manifest_lib.NEXT_SENTENCE_LABEL,
)


@dataclass(frozen=True)
class Segment(FlatRows):
    """One record batch of one shard: zero-copy numpy views of the memory map (offsets: the
    list offsets into values, num_rows + 1; values: flat token ids, uint16 or int32)."""

    path: str = ""  # the shard file, for error messages
    first_row: int = 0  # this record batch's first row within the file


class ShardRows:
    """Random access by global row index over the segments of a split, in manifest order."""

    def __init__(self, segments: list[Segment]):
        self._segments = segments
        self._starts = np.cumsum([0] + [len(s.num_a_tokens) for s in segments], dtype=np.int64)
        self._checked = np.zeros(len(segments), dtype=bool)  # record batches validated so far

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def gather(self, indices: np.ndarray, pad_id: int, rules: RowRules | None = None) -> RowBatch:
        """The rows `indices`, in that order, padded; reads only the pages those rows live on.

        With `rules`, each record batch is validated (`training.data.integrity`) before its
        first row is served, once: no row leaves unchecked.
        """
        indices = np.asarray(indices, dtype=np.int64)
        segment_of = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[segment_of]
        groups = _group_by(segment_of)
        begins, lengths = np.zeros((2, len(indices)), dtype=np.int64)
        num_a, nsp = np.zeros((2, len(indices)), dtype=np.int64)
        for segment_index, rows in groups:
            segment, at = self._segments[segment_index], local[rows]
            if rules is not None and not self._checked[segment_index]:
                check_rows(segment, rules, segment.path, segment.first_row)
                self._checked[segment_index] = True
            begins[rows] = segment.offsets[at]
            lengths[rows] = segment.offsets[at + 1] - begins[rows]
            num_a[rows] = segment.num_a_tokens[at]
            nsp[rows] = segment.next_sentence_label[at]
        input_ids = np.full((len(indices), padded_width(int(lengths.max(initial=0)))), pad_id)
        positions = np.arange(input_ids.shape[1])
        for segment_index, rows in groups:
            values = self._segments[segment_index].values
            flat = np.minimum(begins[rows, None] + positions, len(values) - 1)
            real = positions < lengths[rows, None]
            input_ids[rows] = np.where(real, values[flat], pad_id)
        return RowBatch(input_ids.astype(np.int64, copy=False), lengths, num_a, nsp, indices)

    def row_lengths(self) -> np.ndarray:
        """Tokens of every row in global order, from the list offsets alone (no token reads)."""
        parts = [np.diff(segment.offsets) for segment in self._segments]
        lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        # uint16 holds any BERT length (<= 512): 2 bytes a sample, kept for the loader's life.
        return lengths.astype(np.uint16 if lengths.max(initial=0) < 2**16 else np.int64)

    def iter_token_ids(self) -> Iterator[tuple[Segment, np.ndarray]]:
        """(each record batch, its rows' token ids end to end)."""
        for segment in self._segments:
            yield segment, segment.values[segment.offsets[0] : segment.offsets[-1]]


def _group_by(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, positions holding it) for each distinct key, via one stable sort."""
    order = np.argsort(keys, kind="stable")
    boundaries = np.flatnonzero(np.diff(keys[order])) + 1
    return [(int(keys[part[0]]), part) for part in np.split(order, boundaries) if len(part)]


def open_shard(path: str, expected_rows: int) -> list[Segment]:
    """Memory-map one shard and check it; every error names the file."""
    if not os.path.exists(path):
        if os.path.islink(path):
            raise MissingInputError(f"shard {path} is a symbolic link to a missing file "
                                    f"({os.readlink(path)})")
        raise MissingInputError(f"shard {path} is missing (the manifest lists it)")
    try:
        with pa.memory_map(path) as source:
            # Buffers keep the mapping alive after the file closes: no descriptor per shard.
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except (pa.ArrowException, OSError) as error:
        raise UserInputError(
            f"shard {path} is corrupt or truncated: not a readable Arrow IPC file ({error})"
        ) from error
    missing = [name for name in REQUIRED_COLUMNS if name not in schema.names]
    if missing:
        raise UserInputError(f"shard {path} lacks the columns {missing} (has {schema.names})")
    num_rows = sum(batch.num_rows for batch in batches)
    if num_rows != expected_rows:
        raise UserInputError(
            f"shard {path} has {num_rows} rows but the manifest says {expected_rows}: "
            "it is truncated or was replaced after preparation"
        )
    firsts = np.cumsum([0] + [batch.num_rows for batch in batches])
    return [_segment(path, batch, int(first))
            for batch, first in zip(batches, firsts, strict=False) if batch.num_rows]


def _segment(path: str, batch: pa.RecordBatch, first_row: int) -> Segment:
    ids = batch.column(manifest_lib.INPUT_IDS)
    try:
        return Segment(
            offsets=ids.offsets.to_numpy(),
            values=ids.values.to_numpy(zero_copy_only=True),
            num_a_tokens=batch.column(manifest_lib.NUM_A_TOKENS).to_numpy(zero_copy_only=True),
            next_sentence_label=batch.column(manifest_lib.NEXT_SENTENCE_LABEL).to_numpy(
                zero_copy_only=True
            ),
            path=path,
            first_row=first_row,
        )
    except (pa.ArrowException, AttributeError) as error:
        raise UserInputError(f"shard {path} has unexpected column types ({error})") from error
