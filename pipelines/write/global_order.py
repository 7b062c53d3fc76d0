"""Global order and shard files: exact ranks without a global sort, and Arrow IPC writing.

Every instance carries a sort key `(order_key, doc_id, dupe_index, instance_index)` whose first
element is a stable 64-bit hash, so sorting by it is a uniform shuffle that any worker computes
the same way. Shard `s` of `S` holds the ranks `[ceil(s * N / S), ceil((s + 1) * N / S))`, i.e.
`shard = rank * S // N`: row counts differ by at most one. A global sort is avoided by:

1. counting instances per bucket (the top `BUCKET_BITS` bits of the order key: 65,536 buckets);
2. from the prefix sums, finding the few buckets that contain a shard boundary rank and the
   boundary's rank inside its bucket (`locate_boundaries`);
3. sorting only those buckets' keys to get the exact boundary keys;
4. `shard_of`: a binary search of an instance's key among the boundary keys.

So the full data moves once and only a few small buckets are sorted centrally. A shard is not
grouped whole (its size grows with the corpus): the same boundary search also cuts every shard
into pieces of at most `rows_per_piece` rows (`piece_starts`); pieces are grouped, sorted and
written as small Arrow files, then copied batch by batch into the shard (`concat_shard`), so a
worker holds one piece at a time. Pieces start at multiples of `ROWS_PER_BATCH` from their
shard's start, so the copied batches are exactly the batches of a shard written in one go.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from bertforge.pipelines.contract import manifest

BUCKET_BITS = 16
ROWS_PER_BATCH = 4096  # fixed, so the file bytes depend on the rows only

SortKey = tuple[int, str, int, int]  # (order_key, doc_id, dupe_index, instance_index)
# (sort key, input_ids as bytes of `id_dtype`, num_a_tokens, next_sentence_label)
ShardRow = tuple[SortKey, bytes, int, int]


def bucket_of(order_key):
    """The top BUCKET_BITS bits of an order key, or of a uint64 array of them."""
    return order_key >> (64 - BUCKET_BITS)


def boundary_ranks(num_rows: int, num_shards: int) -> list[int]:
    """First rank of shards 1..S-1, leaving out those past the end (empty shards when N < S).

    rank r is in shard #{s >= 1 : ceil(s * N / S) <= r} = min(S - 1, r * S // N) = r * S // N.
    """
    ranks = [-(-s * num_rows // num_shards) for s in range(1, num_shards)]
    return [r for r in ranks if r < num_rows]


def piece_starts(num_rows: int, num_shards: int, rows_per_piece: int) -> list[int]:
    """First rank of every piece but the first, sorted: shard starts included.

    Each non-empty shard [a, b) is cut at a, a + R, a + 2R, ... (R = rows_per_piece, a multiple
    of ROWS_PER_BATCH), so a piece never spans two shards and holds at most R rows.
    """
    assert rows_per_piece % ROWS_PER_BATCH == 0, rows_per_piece
    starts = [0] + boundary_ranks(num_rows, num_shards)
    ends = starts[1:] + [num_rows]
    cuts = {r for a, b in zip(starts, ends, strict=True) for r in range(a, b, rows_per_piece)}
    return sorted(cuts - {0})


def piece_rows(rows_per_piece: int) -> int:
    """`rows_per_piece` rounded up to whole batches (see `piece_starts`)."""
    return -(-max(1, rows_per_piece) // ROWS_PER_BATCH) * ROWS_PER_BATCH


def locate_ranks(bucket_counts: dict[int, int], ranks: list[int]) -> dict[int, list[tuple]]:
    """{bucket: [(rank inside the bucket, rank)] of each given rank it holds]} for one split."""
    located: dict[int, list[tuple[int, int]]] = {}
    buckets = sorted(bucket_counts)
    offsets = np.cumsum([0] + [bucket_counts[b] for b in buckets])  # offsets[i] = rows before i
    for rank in ranks:
        i = int(np.searchsorted(offsets, rank, side="right")) - 1
        located.setdefault(buckets[i], []).append((rank - int(offsets[i]), rank))
    return located


def locate_boundaries(bucket_counts: dict[int, int], num_shards: int) -> dict[int, list[int]]:
    """{bucket: [rank inside the bucket of each boundary it holds]} for one split."""
    ranks = boundary_ranks(sum(bucket_counts.values()), num_shards)
    located = locate_ranks(bucket_counts, ranks)
    return {bucket: [r for r, _ in pairs] for bucket, pairs in located.items()}


def shard_of(sort_key: SortKey, boundary_keys: list[SortKey]) -> int:
    """The number of shard boundaries at or before `sort_key` (the keys are sorted)."""
    return bisect.bisect_right(boundary_keys, sort_key)


def id_dtype(vocab_size: int) -> np.dtype:
    """Matches `manifest.shard_schema`: uint16 up to 65,535 entries, int32 past that."""
    return np.dtype(np.uint16) if vocab_size <= 65_535 else np.dtype(np.int32)


def _record_batch(
    ids: np.ndarray,
    offsets: np.ndarray,
    num_a: np.ndarray,
    labels: np.ndarray,
    doc_ids: Sequence[str],
    schema: pa.Schema,
) -> pa.RecordBatch:
    arrays = [
        pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids)),
        pa.array(num_a, type=pa.uint16()),
        pa.array(labels, type=pa.int8()),
        pa.array(list(doc_ids), type=pa.string()),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def write_columns(
    sink: BinaryIO,
    ids: np.ndarray,
    lengths: np.ndarray,
    num_a: np.ndarray,
    labels: np.ndarray,
    doc_ids: Sequence[str],
    vocab_size: int,
) -> tuple[int, int]:
    """Write rows given as columns, in order, as one Arrow IPC file; returns (rows, tokens).

    Row r's ids are the next `lengths[r]` entries of `ids` (`id_dtype(vocab_size)`). The IPC
    *file* format (not the stream format) has a footer with every batch's offset, so readers
    memory-map it and reach any row with one seek.
    """
    schema = manifest.shard_schema(vocab_size)
    ids = np.asarray(ids, dtype=id_dtype(vocab_size))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
        for start in range(0, len(lengths), ROWS_PER_BATCH):
            end = min(start + ROWS_PER_BATCH, len(lengths))
            batch_offsets = offsets[start : end + 1] - offsets[start]
            batch_ids = ids[offsets[start] : offsets[end]]
            writer.write_batch(
                _record_batch(
                    batch_ids,
                    batch_offsets,
                    num_a[start:end],
                    labels[start:end],
                    doc_ids[start:end],
                    schema,
                )
            )
    return len(lengths), int(offsets[-1])


def write_shard(
    sink: BinaryIO, rows: Iterable[tuple[bytes, int, int, str]], vocab_size: int
) -> tuple[int, int]:
    """`write_columns` for rows (ids bytes, num_a_tokens, label, doc_id)."""
    rows = list(rows)
    dtype = id_dtype(vocab_size)
    ids = [np.frombuffer(row[0], dtype=dtype) for row in rows]
    return write_columns(
        sink,
        np.concatenate(ids) if ids else np.zeros(0, dtype=dtype),
        np.array([len(x) for x in ids], dtype=np.int64),
        np.array([row[1] for row in rows], dtype=np.uint16),
        np.array([row[2] for row in rows], dtype=np.int8),
        [row[3] for row in rows],
        vocab_size,
    )


def concat_shard(sink: BinaryIO, pieces: Iterable[BinaryIO], vocab_size: int) -> None:
    """Copy the record batches of piece files (written by `write_shard`), in order, into one file.

    One batch is in memory at a time. Pieces hold whole batches (see `piece_starts`), so the
    result has the bytes `write_shard` would give for all the rows at once.
    """
    schema = manifest.shard_schema(vocab_size)
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema) as writer:
        for source in pieces:
            reader = pa.ipc.open_file(pa.PythonFile(source, mode="r"))
            assert reader.schema == schema, reader.schema
            for i in range(reader.num_record_batches):
                writer.write_batch(reader.get_batch(i))
