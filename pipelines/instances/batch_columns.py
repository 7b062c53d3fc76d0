"""Instances as columns: what flows from the random-B pools to the shard writer.

A pool yields its instances as a few `InstanceBatch`es instead of one Beam element per instance.
Per-element costs dominate a Python pipeline (every element is decoded and re-encoded by the runner
at each grouping), so a batch of numpy columns moves ~100,000 instances for the price of one.

A row's sort key is `(order_key, doc_id, dupe_index, instance_index)` (`global_order.SortKey`); the
64-bit `order_key` alone orders rows everywhere except on exact ties, which are settled by the rest
of the tuple so that the order stays total and the same on every worker.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from bertforge.pipelines.write.global_order import SortKey


class RowKeys(NamedTuple):
    """The sort keys of a batch's rows without their tokens: what locating shard boundaries
    reads. A fifth of the batch's bytes or less, so the stage that waits for the boundary plan
    is sent these instead of the whole batch a second time."""

    split: str
    order_keys: np.ndarray  # uint64 [rows]
    doc_ids: tuple[str, ...]  # [rows]
    dupes: np.ndarray  # int32 [rows]
    numbers: np.ndarray  # int32 [rows]

    def __len__(self) -> int:
        return len(self.order_keys)

    def sort_key(self, row: int) -> SortKey:
        return (
            int(self.order_keys[row]),
            self.doc_ids[row],
            int(self.dupes[row]),
            int(self.numbers[row]),
        )


class InstanceBatch(NamedTuple):
    split: str
    order_keys: np.ndarray  # uint64 [rows]
    doc_ids: tuple[str, ...]  # [rows]
    dupes: np.ndarray  # int32 [rows]: dupe_factor pass
    numbers: np.ndarray  # int32 [rows]: instance index within (document, pass)
    ids: np.ndarray  # token ids of every row, concatenated ([CLS] A [SEP] B [SEP])
    lengths: np.ndarray  # int32 [rows]: tokens per row
    num_a: np.ndarray  # uint16 [rows]: len([CLS] A [SEP])
    labels: np.ndarray  # int8 [rows]: next_sentence_label

    def __len__(self) -> int:
        return len(self.order_keys)

    def sort_key(self, row: int) -> SortKey:
        return self.row_keys().sort_key(row)

    def row_keys(self) -> RowKeys:
        return RowKeys(self.split, self.order_keys, self.doc_ids, self.dupes, self.numbers)

    def offsets(self) -> np.ndarray:
        """int64 [rows + 1]: row r's ids are ids[offsets[r]:offsets[r + 1]]."""
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return offsets

    def take(self, rows: np.ndarray) -> InstanceBatch:
        """The given rows, in the given order."""
        offsets = self.offsets()
        starts, ends = offsets[rows], offsets[rows + 1]
        if len(rows):
            # Concatenated ranges [starts[i], ends[i]) without a Python loop over rows.
            lengths = ends - starts
            shift = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
            ids = self.ids[np.arange(lengths.sum()) + shift]
        else:
            ids = self.ids[:0]
        return InstanceBatch(
            self.split,
            self.order_keys[rows],
            tuple(self.doc_ids[r] for r in rows.tolist()),
            self.dupes[rows],
            self.numbers[rows],
            ids,
            self.lengths[rows],
            self.num_a[rows],
            self.labels[rows],
        )

    def sorted(self) -> InstanceBatch:
        return self.take(sort_order(self))


def concat(batches: Sequence[InstanceBatch]) -> InstanceBatch:
    """One batch of every row of `batches` (all of one split), in order."""
    assert batches and len({b.split for b in batches}) == 1
    return InstanceBatch(
        batches[0].split,
        np.concatenate([b.order_keys for b in batches]),
        tuple(doc_id for b in batches for doc_id in b.doc_ids),
        np.concatenate([b.dupes for b in batches]),
        np.concatenate([b.numbers for b in batches]),
        np.concatenate([b.ids for b in batches]),
        np.concatenate([b.lengths for b in batches]),
        np.concatenate([b.num_a for b in batches]),
        np.concatenate([b.labels for b in batches]),
    )


def sort_order(batch: InstanceBatch) -> np.ndarray:
    """Row indices in sort-key order: by order_key, ties settled by the whole key."""
    order = np.argsort(batch.order_keys, kind="stable")
    keys = batch.order_keys[order]
    tied = np.flatnonzero(keys[1:] == keys[:-1])
    if len(tied):  # astronomically rare with 64-bit keys, but the order must stay total
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and keys[end] == keys[start]:
                end += 1
            if end - start > 1:
                order[start:end] = sorted(order[start:end], key=batch.sort_key)
            start = end
    return order


def count_before(batch: InstanceBatch, boundaries: list[SortKey]) -> np.ndarray:
    """int64 [rows]: for each row, how many of the sorted `boundaries` are <= its sort key.

    `bisect_right` on whole keys, vectorized on the order key; only rows whose order key equals a
    boundary's (the boundary rows themselves, and ties) are compared as whole tuples.
    """
    boundary_order_keys = np.array([key[0] for key in boundaries], dtype=np.uint64)
    result = np.searchsorted(boundary_order_keys, batch.order_keys, side="right").astype(np.int64)
    for row in np.flatnonzero(np.isin(batch.order_keys, boundary_order_keys)).tolist():
        result[row] = bisect_right(boundaries, batch.sort_key(row))
    return result
