"""Instance batches -> shard files in exact global order (the Beam side of `global_order`).

Memory per worker is bounded by the piece size, not the shard size: rows are grouped by
piece (at most `rows_per_piece` consecutive ranks of one shard), each piece is sorted and written
as a temporary Arrow file, and a last step per shard streams its pieces' batches into the shard.
"""

from __future__ import annotations

import functools
import logging
import uuid

import apache_beam as beam
import numpy as np
import pyarrow as pa
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import AsSingleton

from bertforge.pipelines.beam_common import count
from bertforge.pipelines.contract import manifest
from bertforge.pipelines.filesystem import sha256_of, sync_if_local
from bertforge.pipelines.instances.batch_columns import (
    InstanceBatch,
    RowKeys,
    concat,
    count_before,
)
from bertforge.pipelines.log_only import LOG_ONLY
from bertforge.pipelines.write import global_order

logger = logging.getLogger(__name__)


# Buckets per combine key: 1,024 (8 KB of counts). Beam merges all of a key's per-bundle
# accumulators in one go, so one key per split would put a whole 512 KB array per bundle into a
# single worker's merge (growing with the corpus); a block per key keeps each merge small.
COUNT_BLOCK_BITS = 10


def bucket_counts(batch: RowKeys):
    """((split, block), rows per bucket of that block) for each block the batch touches."""
    buckets = global_order.bucket_of(batch.order_keys).astype(np.int64)
    counts = np.bincount(buckets, minlength=1 << global_order.BUCKET_BITS)
    for block in np.unique(buckets >> COUNT_BLOCK_BITS).tolist():
        start = block << COUNT_BLOCK_BITS
        yield (batch.split, block), counts[start : start + (1 << COUNT_BLOCK_BITS)].copy()


def add_counts(counts) -> np.ndarray:
    return functools.reduce(np.add, counts)


def plan_boundaries(block_counts: list, shards_per_split: dict[str, int], rows_per_piece: int):
    """[((split, block), rows per bucket)] -> the ranks whose keys cut shards and pieces.

    {"num_rows": {split: N}, "located": {(split, bucket): [(rank inside the bucket, rank)]}}.
    """
    split_counts: dict[str, np.ndarray] = {}
    for (split, block), counts in block_counts:
        start = block << COUNT_BLOCK_BITS
        dense = split_counts.setdefault(split, np.zeros(1 << global_order.BUCKET_BITS,
                                                          dtype=np.int64))
        dense[start : start + len(counts)] = counts
    plan: dict = {"num_rows": {}, "located": {}}
    for split, counts in sorted(split_counts.items()):
        nonzero = np.flatnonzero(counts)
        per_bucket = dict(zip(nonzero.tolist(), counts[nonzero].tolist(), strict=True))
        num_rows = int(counts.sum())
        plan["num_rows"][split] = num_rows
        ranks = global_order.piece_starts(num_rows, shards_per_split[split], rows_per_piece)
        for bucket, pairs in global_order.locate_ranks(per_bucket, ranks).items():
            plan["located"][(split, bucket)] = pairs
    return plan


def keys_in_boundary_buckets(batch: RowKeys, plan: dict):
    """((split, bucket), sort key) of every row in a bucket that holds a boundary rank."""
    located = [bucket for split, bucket in plan["located"] if split == batch.split]
    buckets = global_order.bucket_of(batch.order_keys)
    for row in np.flatnonzero(np.isin(buckets, np.array(located, dtype=np.uint64))).tolist():
        yield (batch.split, int(buckets[row])), batch.sort_key(row)


def pick_boundary_keys(item, plan: dict):
    (split, bucket), keys = item
    keys = sorted(keys)
    for rank_in_bucket, rank in plan["located"][(split, bucket)]:
        yield split, (rank, keys[rank_in_bucket])


def boundary_keys_by_split(pairs: list, plan: dict, shards_per_split: dict[str, int]) -> dict:
    """{split: (shard boundary keys, piece start keys)}, both sorted.

    Shard boundaries repeat a rank where a shard is empty (N < S): kept, so `shard_of` skips it.
    """
    key_at: dict[str, dict[int, tuple]] = {}
    for split, (rank, key) in pairs:
        key_at.setdefault(split, {})[rank] = key
    bounds = {}
    for split, num_rows in plan["num_rows"].items():
        keys = key_at.get(split, {})
        shard_ranks = global_order.boundary_ranks(num_rows, shards_per_split[split])
        bounds[split] = ([keys[r] for r in shard_ranks], [keys[r] for r in sorted(keys)])
    return bounds


def split_into_pieces(batch: InstanceBatch, bounds: dict):
    """A batch -> ((split, shard, piece), the batch's rows in that piece) per piece it touches."""
    shard_keys, piece_keys = bounds[batch.split]
    shard = count_before(batch, shard_keys)
    piece = count_before(batch, piece_keys)
    order = np.argsort(piece, kind="stable")
    starts = np.flatnonzero(np.r_[True, piece[order][1:] != piece[order][:-1]])
    for rows in np.split(order, starts[1:]):
        first = int(rows[0])
        yield (batch.split, int(shard[first]), int(piece[first])), batch.take(rows)


def _create(path: str):
    return FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED)


class WritePieceFile(beam.DoFn):
    """((split, shard, piece), rows) -> a sorted temporary piece file beside its shard.

    Yields ((split, shard), (piece, path, num_rows, num_tokens)) for the shard's last step.
    """

    def __init__(self, output: str, vocab_size: int, shards_per_split: dict[str, int]):
        self._output = output
        self._vocab_size = vocab_size
        self._shards_per_split = shards_per_split

    def process(self, item):
        (split, index, piece), batches = item
        rows = concat(list(batches)).sorted()
        rel_path = manifest.shard_file_name(split, index, self._shards_per_split[split])
        # Unique: a retried bundle may race an old one; only the committed output's file is used.
        path = FileSystems.join(self._output, f"{rel_path}.piece{piece}-{uuid.uuid4().hex}.tmp")
        sink = _create(path)
        try:
            num_rows, num_tokens = global_order.write_columns(
                sink,
                rows.ids,
                rows.lengths,
                rows.num_a,
                rows.labels,
                rows.doc_ids,
                self._vocab_size,
            )
        finally:
            sink.close()
        sync_if_local(path)  # the bundle's record, which names it, is synced once it is done
        yield (split, index), (piece, path, num_rows, num_tokens)


def written_by_an_earlier_attempt(path: str, pieces_gone: bool, num_rows: int) -> bool:
    """Whether an attempt of this bundle killed after its rename (before the bundle counted as
    done: a `kill -9` of a local prepare, a Dataflow worker lost) wrote the shard already: its
    pieces are deleted only once the shard is in place, so a redo found some gone, and every
    rerun of the same command failed on them. A shard of other rows (an older dataset's, a
    damaged file) is not it: a piece gone with no such shard fails the open, naming the piece."""
    if not pieces_gone or not FileSystems.exists(path):
        return False
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            reader = pa.ipc.open_file(pa.PythonFile(f, mode="r"))
            rows = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except (pa.ArrowInvalid, OSError):
        return False
    return rows == num_rows


class WriteShardFile(beam.DoFn):
    """((split, index), pieces) -> the shard file from its pieces in order; pieces deleted."""

    def __init__(self, output: str, vocab_size: int, shards_per_split: dict[str, int]):
        self._output = output
        self._vocab_size = vocab_size
        self._shards_per_split = shards_per_split

    def process(self, item):
        (split, index), values = item
        pieces = sorted(v for v in values if v is not None)
        rel_path = manifest.shard_file_name(split, index, self._shards_per_split[split])
        path = FileSystems.join(self._output, rel_path)
        num_rows, num_tokens = sum(p[2] for p in pieces), sum(p[3] for p in pieces)
        left = [p[1] for p in pieces if FileSystems.exists(p[1])]
        if not written_by_an_earlier_attempt(path, len(left) < len(pieces), num_rows):
            tmp_path = f"{path}.tmp-{uuid.uuid4().hex}"  # unique: a retried bundle may race
            sink = _create(tmp_path)
            try:
                global_order.concat_shard(sink, self._open_all(p[1] for p in pieces),
                                          self._vocab_size)
            finally:
                sink.close()
            sync_if_local(tmp_path)  # before the bundle that made it counts as done
            FileSystems.rename([tmp_path], [path])
        if left:
            FileSystems.delete(left)
        count("tokens", num_tokens)
        # An empty shard is in the manifest all the same; its line on the console would be
        # noise, and with no document at all five such lines came before the one-line error
        # (whose run then removes them).
        (logger.info if num_rows else logger.debug)(
            "wrote %s: %d rows, %d tokens, %d pieces", rel_path, num_rows, num_tokens, len(pieces),
            extra=LOG_ONLY)
        yield {
            "split": split,
            "index": index,
            "path": rel_path,
            "num_rows": num_rows,
            "num_tokens": num_tokens,
            "sha256": sha256_of(path),
        }

    @staticmethod
    def _open_all(paths):
        for piece_path in paths:
            with FileSystems.open(piece_path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
                yield f


class WriteShards(beam.PTransform):
    """`InstanceBatch`es -> shard files in exact global order; yields one entry dict per shard."""

    def __init__(
        self,
        output: str,
        vocab_size: int,
        shards_per_split: dict[str, int],
        rows_per_piece: int = 8_192,
    ):
        super().__init__()
        self._output = output
        self._vocab_size = vocab_size
        self._shards_per_split = shards_per_split
        self._rows_per_piece = global_order.piece_rows(rows_per_piece)

    def expand(self, instances):
        shards_per_split = self._shards_per_split
        # Fused into the step that makes the instances: the boundary step, which must wait for
        # the plan, then reads these keys, not the whole instances a second time (a pass over
        # all the tokens through the runner saved).
        row_keys = instances | "RowKeys" >> beam.Map(InstanceBatch.row_keys)
        plan = (
            row_keys
            | "CountPerBucket" >> beam.FlatMap(bucket_counts)
            | "SumPerBlock" >> beam.CombinePerKey(add_counts)
            | "BucketCounts" >> beam.combiners.ToList()
            | "LocateBoundaries"
            >> beam.Map(plan_boundaries, shards_per_split, self._rows_per_piece)
        )
        boundaries = (
            row_keys
            | "KeysInBoundaryBuckets" >> beam.FlatMap(keys_in_boundary_buckets, AsSingleton(plan))
            | "GroupBoundaryBuckets" >> beam.GroupByKey()
            | "PickBoundaryKeys" >> beam.FlatMap(pick_boundary_keys, AsSingleton(plan))
            | "BoundaryKeys" >> beam.combiners.ToList()
            | "BoundaryKeysBySplit"
            >> beam.Map(boundary_keys_by_split, AsSingleton(plan), shards_per_split)
        )
        pieces = (
            instances
            | "SplitIntoPieces" >> beam.FlatMap(split_into_pieces, AsSingleton(boundaries))
            | "GroupPieces" >> beam.GroupByKey()
            | "WritePieceFiles"
            >> beam.ParDo(WritePieceFile(self._output, self._vocab_size, shards_per_split))
        )
        # Every declared shard is written, empty or not, so the manifest lists complete splits.
        every_shard = instances.pipeline | "EveryShard" >> beam.Create(
            [((split, i), None) for split, n in sorted(shards_per_split.items()) for i in range(n)]
        )
        return (
            (pieces, every_shard)
            | "FlattenShardPieces" >> beam.Flatten()
            | "GroupShards" >> beam.GroupByKey()
            | "WriteShardFiles"
            >> beam.ParDo(WriteShardFile(self._output, self._vocab_size, shards_per_split))
        )
