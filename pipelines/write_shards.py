"""Keyed instances -> shard files in exact global order (the Beam side of `pipelines.shards`)."""

from __future__ import annotations

import logging
import uuid

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import AsSingleton

from pipelines import manifest, shards
from pipelines.beam_common import count
from pipelines.filesystem import sha256_of

logger = logging.getLogger(__name__)


def plan_boundaries(bucket_counts: list, shards_per_split: dict[str, int]) -> dict:
    """[((split, bucket), count)] -> {(split, bucket): [boundary ranks inside the bucket]}."""
    per_split: dict[str, dict[int, int]] = {}
    for (split, bucket), num_rows in bucket_counts:
        per_split.setdefault(split, {})[bucket] = num_rows
    plan = {}
    for split, counts in per_split.items():
        for bucket, ranks in shards.locate_boundaries(counts, shards_per_split[split]).items():
            plan[(split, bucket)] = ranks
    return plan


def keys_in_boundary_buckets(instance, plan: dict):
    split, sort_key, _ = instance
    bucket = (split, shards.bucket_of(sort_key[0]))
    if bucket in plan:
        yield bucket, sort_key


def pick_boundary_keys(item, plan: dict):
    (split, bucket), keys = item
    keys = sorted(keys)
    for rank in plan[(split, bucket)]:
        yield split, keys[rank]


def boundary_keys_by_split(pairs: list) -> dict[str, list]:
    by_split: dict[str, list] = {}
    for split, key in pairs:
        by_split.setdefault(split, []).append(key)
    return {split: sorted(keys) for split, keys in by_split.items()}


class WriteShardFile(beam.DoFn):
    """((split, index), rows) -> the shard file, written under a temp name and renamed."""

    def __init__(self, output: str, vocab_size: int, shards_per_split: dict[str, int]):
        self._output = output
        self._vocab_size = vocab_size
        self._shards_per_split = shards_per_split

    def process(self, item):
        (split, index), values = item
        rows = sorted((v for v in values if v is not None), key=lambda v: v[0])
        rel_path = manifest.shard_file_name(split, index, self._shards_per_split[split])
        path = FileSystems.join(self._output, rel_path)
        tmp_path = f"{path}.tmp-{uuid.uuid4().hex}"  # unique: a retried bundle may race an old one
        sink = FileSystems.create(tmp_path, compression_type=CompressionTypes.UNCOMPRESSED)
        try:
            num_rows, num_tokens = shards.write_shard(
                sink,
                ((ids, num_a, label, key[1]) for key, (ids, num_a, label) in rows),
                self._vocab_size,
            )
        finally:
            sink.close()
        FileSystems.rename([tmp_path], [path])
        count("tokens", num_tokens)
        logger.info("wrote %s: %d rows, %d tokens", rel_path, num_rows, num_tokens)
        yield {
            "split": split,
            "index": index,
            "path": rel_path,
            "num_rows": num_rows,
            "num_tokens": num_tokens,
            "sha256": sha256_of(path),
        }


class WriteShards(beam.PTransform):
    """Keyed instances -> shard files in exact global order; yields one entry dict per shard."""

    def __init__(self, output: str, vocab_size: int, shards_per_split: dict[str, int]):
        super().__init__()
        self._output = output
        self._vocab_size = vocab_size
        self._shards_per_split = shards_per_split

    def expand(self, instances):
        shards_per_split = self._shards_per_split
        plan = (
            instances
            | "KeyByBucket" >> beam.Map(lambda x: ((x[0], shards.bucket_of(x[1][0])), 1))
            | "CountPerBucket" >> beam.CombinePerKey(sum)
            | "BucketCounts" >> beam.combiners.ToList()
            | "LocateBoundaries" >> beam.Map(plan_boundaries, shards_per_split)
        )
        boundaries = (
            instances
            | "KeysInBoundaryBuckets" >> beam.FlatMap(keys_in_boundary_buckets, AsSingleton(plan))
            | "GroupBoundaryBuckets" >> beam.GroupByKey()
            | "PickBoundaryKeys" >> beam.FlatMap(pick_boundary_keys, AsSingleton(plan))
            | "BoundaryKeys" >> beam.combiners.ToList()
            | "BoundaryKeysBySplit" >> beam.Map(boundary_keys_by_split)
        )
        assigned = instances | "AssignShard" >> beam.Map(
            lambda x, bounds: ((x[0], shards.shard_of(x[1], bounds.get(x[0], []))), (x[1], x[2])),
            AsSingleton(boundaries),
        )
        # Every declared shard is written, empty or not, so the manifest lists complete splits.
        every_shard = instances.pipeline | "EveryShard" >> beam.Create(
            [((split, i), None) for split, n in sorted(shards_per_split.items()) for i in range(n)]
        )
        return (
            (assigned, every_shard)
            | "FlattenShardRows" >> beam.Flatten()
            | "GroupShards" >> beam.GroupByKey()
            | "WriteShardFiles"
            >> beam.ParDo(WriteShardFile(self._output, self._vocab_size, shards_per_split))
        )
