"""The preparation job: corpus files -> documents -> sentence-pair instances -> Arrow shards.

    files --ReadFiles--> raw documents --CreatePretrainingInstances--> keyed instances
          --WriteShards--> train/*.arrow, validation/*.arrow
    rejects --WriteRejects--> rejects.jsonl
    all of the above --WriteManifest--> vocab.txt, manifest.json (last)

Inside `CreatePretrainingInstances`:
- sentences split, documents with fewer than two dropped, exact duplicates (same sentences) kept
  once (the smallest doc_id), doc_id collisions resolved;
- each document goes to `validation` when `unit_interval(seed, "split", doc_id)` is below the
  validation fraction, so no document contributes to both splits;
- random-B pools: a document joins pool `stable_hash(seed, "pool", doc_id) % num_pools` of its
  split, `num_pools = ceil(num_documents_in_split / random_pool_size)`. A pool is a uniform random
  sample of the split (not a contiguous range of the input, as NVIDIA's LDDL bins are), so a random
  B is drawn from anywhere in the corpus while a worker holds only one pool in memory.

Global order: see `pipelines/shards.py`. Every decision hashes (seed, a stable key), and every
group is sorted before use, so shards are byte-identical for any runner and number of workers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.pvalue import AsDict, AsSingleton, TaggedOutput

from pipelines import manifest, readers, shards
from pipelines.instances import (
    create_instances_from_document,
    document_rng,
    stable_hash,
    unit_interval,
)
from pipelines.sentences import split_sentences
from pipelines.tokenization import load_tokenizer, read_vocab

logger = logging.getLogger(__name__)

METRICS_NAMESPACE = "bertforge.prepare"
REJECTS = "rejects"
LOG_EVERY_DOCUMENTS = 10_000
NO_DOCUMENTS_MESSAGE = "no usable document remains"


# --------------------------------------------------------------------------- options and config


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if value.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


class PrepareOptions(PipelineOptions):
    """The job's own flags; every other flag goes to Beam (`--runner`, `--direct_num_workers`...).

    Nothing is `required=True` here: Beam parses every PipelineOptions subclass for any pipeline in
    the process, so a required flag would break unrelated pipelines. `PrepareConfig` validates.
    """

    @classmethod
    def _add_argparse_args(cls, parser: Any) -> None:
        parser.add_argument(
            "--input",
            action="append",
            default=None,
            help="corpus file or glob; repeatable and/or comma-separated. .jsonl/.json: JSON Lines "
            "with 'text' (and optional 'doc_id'); other: one sentence per line, blank line "
            "between documents. .gz/.bz2 are decompressed.",
        )
        parser.add_argument("--output", default=None, help="dataset directory to write")
        parser.add_argument("--vocab", default=None, help="WordPiece vocab.txt")
        parser.add_argument("--lower_case", type=_parse_bool, nargs="?", const=True, default=True)
        parser.add_argument("--max_seq_length", type=int, default=128)
        parser.add_argument("--short_seq_prob", type=float, default=0.1)
        parser.add_argument(
            "--dupe_factor",
            type=int,
            default=1,
            help="passes over each document with different pairings. Google used 10 to get 10 "
            "static maskings; masking here is dynamic (new every epoch), so 1 suffices.",
        )
        parser.add_argument("--seed", type=int, default=12345)
        parser.add_argument("--validation_fraction", type=float, default=0.05)
        parser.add_argument("--num_shards", type=int, default=4, help="train shards")
        parser.add_argument(
            "--num_validation_shards",
            type=int,
            default=0,
            help="0 = max(1, num_shards // 10): the validation split is ~5%% of the data, so it "
            "gets about a tenth of the shards, at least one",
        )
        parser.add_argument(
            "--random_pool_size",
            type=int,
            default=512,
            help="documents per random-B pool: bounds worker memory, not the corpus size",
        )


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]
    output: str
    vocab: str
    lower_case: bool = True
    max_seq_length: int = 128
    short_seq_prob: float = 0.1
    dupe_factor: int = 1
    seed: int = 12345
    validation_fraction: float = 0.05
    num_shards: int = 4
    num_validation_shards: int = 0
    random_pool_size: int = 512

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("--input is required (a corpus file or glob)")
        if not self.output:
            raise ValueError("--output is required (the dataset directory)")
        if not self.vocab:
            raise ValueError("--vocab is required (a WordPiece vocab.txt)")
        if self.max_seq_length < 5:
            raise ValueError(f"--max_seq_length must be at least 5, got {self.max_seq_length}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(
                f"--validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )
        for name in ("dupe_factor", "num_shards", "random_pool_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.num_validation_shards < 0:
            raise ValueError(
                f"--num_validation_shards must be >= 0, got {self.num_validation_shards}"
            )

    @classmethod
    def from_options(cls, options: PipelineOptions) -> PrepareConfig:
        flags = options.view_as(PrepareOptions)
        inputs = tuple(
            p.strip() for entry in flags.input or () for p in entry.split(",") if p.strip()
        )
        return cls(
            inputs=inputs,
            output=flags.output,
            vocab=flags.vocab,
            lower_case=flags.lower_case,
            max_seq_length=flags.max_seq_length,
            short_seq_prob=flags.short_seq_prob,
            dupe_factor=flags.dupe_factor,
            seed=flags.seed,
            validation_fraction=flags.validation_fraction,
            num_shards=flags.num_shards,
            num_validation_shards=flags.num_validation_shards,
            random_pool_size=flags.random_pool_size,
        )

    def shards_per_split(self) -> dict[str, int]:
        """{split: number of shard files}; no validation split when its fraction is 0."""
        counts = {"train": self.num_shards}
        if self.validation_fraction > 0:
            counts["validation"] = self.num_validation_shards or max(1, self.num_shards // 10)
        return counts

    def instance_params(self) -> dict[str, Any]:
        params = asdict(self)
        for key in ("inputs", "output", "vocab"):
            params.pop(key)
        params["num_validation_shards"] = self.shards_per_split().get("validation", 0)
        return params


# --------------------------------------------------------------------------- documents


class Doc(NamedTuple):
    doc_id: str
    source: str
    sentences: tuple[str, ...]
    text_hash: str


def text_hash(sentences: tuple[str, ...]) -> str:
    return hashlib.blake2b("\n".join(sentences).encode("utf-8"), digest_size=16).hexdigest()


def _count(name: str, value: int = 1) -> None:
    Metrics.counter(METRICS_NAMESPACE, name).inc(value)


def _reject(reason: str, source: str, doc_id: str = "", detail: str = "") -> TaggedOutput:
    _count(f"rejected_{reason}")
    return TaggedOutput(REJECTS, readers.Reject(reason, source, doc_id, detail))


class ReadFile(beam.DoFn):
    """(path, doc_id prefix) -> raw documents, and rejects for unreadable records."""

    def process(self, path_and_prefix: tuple[str, str]):
        path, prefix = path_and_prefix
        num_documents = num_rejects = 0
        with FileSystems.open(path) as stream:  # .gz/.bz2 decompressed by extension
            for item in readers.read_documents(path, prefix, stream):
                if isinstance(item, readers.Reject):
                    num_rejects += 1
                    yield _reject(item.reason, item.source, item.doc_id, item.detail)
                else:
                    num_documents += 1
                    if num_documents % (10 * LOG_EVERY_DOCUMENTS) == 0:
                        logger.info("read %s: %d documents so far", path, num_documents)
                    yield item
        _count("input_documents", num_documents)
        logger.info("read %s: %d documents, %d rejected records", path, num_documents, num_rejects)


class SplitSentences(beam.DoFn):
    """Raw document -> `Doc` with its sentences; fewer than two sentences cannot make a pair."""

    def setup(self) -> None:
        self._num_seen = 0

    def process(self, raw: readers.RawDocument):
        sentences = (
            raw.sentences if raw.sentences is not None else tuple(split_sentences(raw.text or ""))
        )
        self._num_seen += 1
        if self._num_seen % LOG_EVERY_DOCUMENTS == 0:
            logger.info("split sentences of %d documents in this worker", self._num_seen)
        if not sentences:
            yield _reject("empty_document", raw.source, raw.doc_id)
        elif len(sentences) < 2:
            yield _reject("too_few_sentences", raw.source, raw.doc_id, f"{len(sentences)} sentence")
        else:
            yield Doc(raw.doc_id, raw.source, sentences, text_hash(sentences))


def keep_first_copy(item: tuple[str, Any]):
    """Of documents with identical sentences keep the smallest doc_id; reject the others."""
    _, copies = item
    copies = sorted(copies, key=lambda d: (d.doc_id, d.source))
    yield copies[0]
    for doc in copies[1:]:
        yield _reject(
            "duplicate_document", doc.source, doc.doc_id, f"same text as {copies[0].doc_id}"
        )


def colliding_ids(item: tuple[str, Any]):
    """(doc_id, text hash kept) for a doc_id that names different texts (set by the input)."""
    doc_id, hashes = item
    hashes = sorted(set(hashes))
    if len(hashes) > 1:
        yield doc_id, hashes[0]


def drop_id_collisions(doc: Doc, collisions: dict[str, str]):
    kept_hash = collisions.get(doc.doc_id)
    if kept_hash is not None and doc.text_hash != kept_hash:
        yield _reject("duplicate_doc_id", doc.source, doc.doc_id, "another text has this doc_id")
    else:
        yield doc


def split_of(seed: int, doc_id: str, validation_fraction: float) -> str:
    return "validation" if unit_interval(seed, "split", doc_id) < validation_fraction else "train"


def key_by_split(doc: Doc, seed: int, validation_fraction: float) -> tuple[str, Doc]:
    """The split of a document that survived every filter (counted here)."""
    _count("documents")
    _count("sentences", len(doc.sentences))
    return split_of(seed, doc.doc_id, validation_fraction), doc


def num_pools(num_documents: int, random_pool_size: int) -> int:
    return max(1, math.ceil(num_documents / random_pool_size))


def pool_of(seed: int, doc_id: str, num_documents: int, random_pool_size: int) -> int:
    return stable_hash(seed, "pool", doc_id) % num_pools(num_documents, random_pool_size)


def key_by_pool(
    split_and_doc: tuple[str, Doc], num_docs: dict[str, int], seed: int, pool_size: int
):
    split, doc = split_and_doc
    return (split, pool_of(seed, doc.doc_id, num_docs[split], pool_size)), doc


# --------------------------------------------------------------------------- instances


class CreateInstancesFromPool(beam.DoFn):
    """((split, pool), documents) -> (split, sort key, (ids bytes, num_a_tokens, label)).

    The vocabulary travels inside the DoFn as bytes, so workers need no access to its path.
    """

    def __init__(self, config: PrepareConfig, vocab_bytes: bytes):
        self._config = config
        self._vocab_bytes = vocab_bytes

    def setup(self) -> None:
        with tempfile.NamedTemporaryFile("wb", suffix="-vocab.txt", delete=False) as f:
            f.write(self._vocab_bytes)
        try:
            vocab = read_vocab(f.name)
            self._tokenizer = load_tokenizer(f.name, self._config.lower_case)
        finally:
            os.remove(f.name)
        self._cls_id, self._sep_id = vocab["[CLS]"], vocab["[SEP]"]
        self._dtype = shards.id_dtype(len(vocab))

    def _tokenize(self, docs: list[Doc]) -> list[list[list[int]]]:
        """Token ids per sentence per document, one `encode_batch` call for the whole pool.

        Sentences that normalize to nothing (control characters only) are dropped.
        """
        flat = [sentence for doc in docs for sentence in doc.sentences]
        encodings = self._tokenizer.encode_batch(flat, add_special_tokens=False)
        tokenized, start = [], 0
        for doc in docs:
            sentences = encodings[start : start + len(doc.sentences)]
            tokenized.append([e.ids for e in sentences if e.ids])
            start += len(doc.sentences)
        return tokenized

    def process(self, item: tuple[tuple[str, int], Any]):
        (split, pool), docs = item
        docs = sorted(docs, key=lambda d: d.doc_id)  # the pool's order must not depend on workers
        kept, token_docs = [], []
        for doc, sentences in zip(docs, self._tokenize(docs), strict=True):
            if sentences:
                kept.append(doc)
                token_docs.append(sentences)
            else:
                yield _reject("empty_after_tokenization", doc.source, doc.doc_id)
        num_instances = 0
        for dupe in range(self._config.dupe_factor):
            for index, doc in enumerate(kept):
                instances = self._instances(index, doc.doc_id, dupe, token_docs)
                for number, instance in enumerate(instances):
                    num_instances += 1
                    yield split, self._sort_key(doc.doc_id, dupe, number), self._payload(instance)
        _count("instances", num_instances)
        logger.info(
            "pool %s/%d: %d documents -> %d instances", split, pool, len(kept), num_instances
        )

    def _sort_key(self, doc_id: str, dupe: int, number: int) -> shards.SortKey:
        """A uniform shuffle key; the rest of the tuple only breaks (astronomically rare) ties."""
        return stable_hash(self._config.seed, "order", doc_id, dupe, number), doc_id, dupe, number

    def _payload(self, instance) -> tuple[bytes, int, int]:
        # 2 bytes per id in the shuffle instead of a pickled list of Python ints.
        ids = np.asarray(instance.input_ids, dtype=self._dtype).tobytes()
        return ids, instance.num_a_tokens, instance.next_sentence_label

    def _instances(self, index: int, doc_id: str, dupe: int, token_docs: list[list[list[int]]]):
        return create_instances_from_document(
            index,
            token_docs,
            max_seq_length=self._config.max_seq_length,
            short_seq_prob=self._config.short_seq_prob,
            rng=document_rng(self._config.seed, doc_id, dupe),
            cls_id=self._cls_id,
            sep_id=self._sep_id,
        )


def _sum_pairs(pairs) -> tuple[int, int]:
    pairs = list(pairs)
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


class CreatePretrainingInstances(beam.PTransform):
    """Raw documents -> {"instances", "rejects", "document_stats"}.

    instances: (split, sort key, (input_ids bytes, num_a_tokens, next_sentence_label));
    document_stats: one dict {split: (num_documents, num_sentences)}.
    """

    def __init__(self, config: PrepareConfig, vocab_bytes: bytes):
        super().__init__()
        self._config = config
        self._vocab_bytes = vocab_bytes

    def expand(self, raw_documents):
        config = self._config
        split = raw_documents | "SplitSentences" >> beam.ParDo(SplitSentences()).with_outputs(
            REJECTS, main="docs"
        )
        unique = (
            split.docs
            | "KeyByText" >> beam.Map(lambda d: (d.text_hash, d))
            | "GroupSameText" >> beam.GroupByKey()
            | "KeepFirstCopy" >> beam.FlatMap(keep_first_copy).with_outputs(REJECTS, main="docs")
        )
        collisions = (
            unique.docs
            | "KeyById" >> beam.Map(lambda d: (d.doc_id, d.text_hash))
            | "GroupSameId" >> beam.GroupByKey()
            | "CollidingIds" >> beam.FlatMap(colliding_ids)
        )
        docs = unique.docs | "DropIdCollisions" >> beam.FlatMap(
            drop_id_collisions, AsDict(collisions)
        ).with_outputs(REJECTS, main="docs")
        by_split = docs.docs | "AssignSplit" >> beam.Map(
            key_by_split, config.seed, config.validation_fraction
        )
        num_docs = (
            by_split
            | "SplitNames" >> beam.Keys()
            | "CountPerSplit" >> beam.combiners.Count.PerElement()
        )
        document_stats = (
            by_split
            | "DocSentences" >> beam.MapTuple(lambda s, d: (s, (1, len(d.sentences))))
            | "SumPerSplit" >> beam.CombinePerKey(_sum_pairs)
            | "StatsDict" >> beam.combiners.ToDict()
        )
        instances = (
            by_split
            | "AssignPool"
            >> beam.Map(key_by_pool, AsDict(num_docs), config.seed, config.random_pool_size)
            | "GroupPools" >> beam.GroupByKey()
            | "CreateInstances"
            >> beam.ParDo(CreateInstancesFromPool(config, self._vocab_bytes)).with_outputs(
                REJECTS, main="instances"
            )
        )
        rejects = (
            split[REJECTS],
            unique[REJECTS],
            docs[REJECTS],
            instances[REJECTS],
        ) | "FlattenRejects" >> beam.Flatten()
        return {
            "instances": instances.instances,
            "rejects": rejects,
            "document_stats": document_stats,
        }


# --------------------------------------------------------------------------- global order, shards


def plan_boundaries(bucket_counts: list, shards_per_split: dict[str, int]) -> dict:
    """[((split, bucket), count)] -> {(split, bucket): [boundary ranks inside the bucket]}."""
    per_split: dict[str, dict[int, int]] = {}
    for (split, bucket), count in bucket_counts:
        per_split.setdefault(split, {})[bucket] = count
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
        _count("tokens", num_tokens)
        logger.info("wrote %s: %d rows, %d tokens", rel_path, num_rows, num_tokens)
        yield {
            "split": split,
            "index": index,
            "path": rel_path,
            "num_rows": num_rows,
            "num_tokens": num_tokens,
            "sha256": _sha256(path),
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


# --------------------------------------------------------------------------- rejects, manifest


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_bytes(path: str, data: bytes) -> None:
    tmp_path = f"{path}.tmp-{uuid.uuid4().hex}"
    with FileSystems.create(tmp_path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)
    FileSystems.rename([tmp_path], [path])


def write_rejects_file(rejects: list, output: str) -> dict[str, int]:
    """Write every reject, sorted, one JSON object per line; return {reason: count}."""
    rejects = sorted(rejects)
    lines = "".join(readers.Reject(*r).to_json() + "\n" for r in rejects)
    _write_bytes(FileSystems.join(output, manifest.REJECTS_NAME), lines.encode("utf-8"))
    counts = Counter(r[0] for r in rejects)
    logger.info("wrote %s: %d rejects %s", manifest.REJECTS_NAME, len(rejects), dict(counts))
    return dict(sorted(counts.items()))


class WriteManifest(beam.DoFn):
    """Copies vocab.txt, then writes manifest.json.

    Every other output is a side input of this step, so it runs last.
    """

    def __init__(self, config: PrepareConfig, vocab_bytes: bytes, vocab_size: int):
        self._config = config
        self._vocab_bytes = vocab_bytes
        self._vocab_size = vocab_size

    def process(self, _, shard_entries, rejected, document_stats, num_input_records):
        num_documents = sum(stats[0] for stats in document_stats.values())
        if num_documents == 0:
            raise ValueError(
                f"{NO_DOCUMENTS_MESSAGE}: {num_input_records} input records read from "
                f"{list(self._config.inputs)}, rejected: {rejected or 'none'}"
            )
        output = self._config.output
        _write_bytes(FileSystems.join(output, manifest.VOCAB_NAME), self._vocab_bytes)
        result = build_manifest(
            self._config,
            self._vocab_bytes,
            self._vocab_size,
            shard_entries,
            rejected,
            document_stats,
            num_input_records,
        )
        if "://" in output:
            _write_bytes(
                FileSystems.join(output, manifest.MANIFEST_NAME), result.to_json().encode("utf-8")
            )
        else:
            manifest.write_manifest(output, result)
        logger.info("wrote %s", FileSystems.join(output, manifest.MANIFEST_NAME))
        yield result.counts


def build_manifest(
    config: PrepareConfig,
    vocab_bytes: bytes,
    vocab_size: int,
    shard_entries: list[dict],
    rejected: dict[str, int],
    document_stats: dict,
    num_input_records: int,
) -> manifest.Manifest:
    splits = {}
    for split in config.shards_per_split():
        entries = sorted(
            (e for e in shard_entries if e["split"] == split), key=lambda e: e["index"]
        )
        shard_list = [
            manifest.ShardEntry(e["path"], e["num_rows"], e["num_tokens"], e["sha256"])
            for e in entries
        ]
        splits[split] = manifest.SplitEntry(
            num_instances=sum(e.num_rows for e in shard_list),
            num_tokens=sum(e.num_tokens for e in shard_list),
            num_documents=document_stats.get(split, (0, 0))[0],
            shards=shard_list,
        )
    counts = {
        # input_records = documents + rejected, but for empty_after_tokenization: such documents
        # are counted in their split before tokenization finds them empty (rare: control
        # characters only).
        "input_records": num_input_records,
        "documents": sum(s[0] for s in document_stats.values()),
        "sentences": sum(s[1] for s in document_stats.values()),
        "instances": sum(s.num_instances for s in splits.values()),
        "tokens": sum(s.num_tokens for s in splits.values()),
        "rejected": rejected,
    }
    tokenizer = manifest.TokenizerEntry(
        hashlib.sha256(vocab_bytes).hexdigest(), vocab_size, config.lower_case
    )
    return manifest.Manifest(
        tokenizer=tokenizer,
        instance_params=config.instance_params(),
        splits=splits,
        counts=counts,
        extra={"inputs": list(config.inputs)},
    )


# --------------------------------------------------------------------------- the job


class PrepareDataset(beam.PTransform):
    """The whole job on a pipeline: read, create instances, write shards, rejects and manifest."""

    def __init__(self, config: PrepareConfig, files: list[str], vocab_bytes: bytes):
        super().__init__()
        self._config = config
        self._files = files
        self._vocab_bytes = vocab_bytes
        self._vocab_size = len(_parse_vocab(vocab_bytes))

    def expand(self, pbegin):
        config = self._config
        prefixes = readers.doc_id_prefixes(self._files)
        read = (
            pbegin
            | "ListFiles" >> beam.Create(sorted(prefixes.items()))
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadFiles" >> beam.ParDo(ReadFile()).with_outputs(REJECTS, main="documents")
        )
        # One file yields many documents: spread them before the per-document work.
        raw_documents = read.documents | "SpreadDocuments" >> beam.Reshuffle()
        # Every input record is a document or a read reject: the manifest's accounting starts here.
        num_input_records = (
            (read.documents, read[REJECTS])
            | "AllRecords" >> beam.Flatten()
            | "CountInputRecords" >> beam.combiners.Count.Globally()
        )
        created = raw_documents | "CreatePretrainingInstances" >> CreatePretrainingInstances(
            config, self._vocab_bytes
        )
        shard_entries = created["instances"] | "WriteShards" >> WriteShards(
            config.output, self._vocab_size, config.shards_per_split()
        )
        rejected = (
            (read[REJECTS], created["rejects"])
            | "AllRejects" >> beam.Flatten()
            | "RejectTuples" >> beam.Map(tuple)
            | "RejectList" >> beam.combiners.ToList()
            | "WriteRejects" >> beam.Map(write_rejects_file, config.output)
        )
        return (
            pbegin
            | "Finish" >> beam.Create([None])
            | "WriteManifest"
            >> beam.ParDo(
                WriteManifest(config, self._vocab_bytes, self._vocab_size),
                beam.pvalue.AsList(shard_entries),
                AsSingleton(rejected),
                AsSingleton(created["document_stats"]),
                AsSingleton(num_input_records),
            )
        )


def _parse_vocab(vocab_bytes: bytes) -> dict[str, int]:
    """`read_vocab` on bytes (it validates the special tokens)."""
    with tempfile.NamedTemporaryFile("wb", suffix="-vocab.txt", delete=False) as f:
        f.write(vocab_bytes)
    try:
        return read_vocab(f.name)
    finally:
        os.remove(f.name)


def match_inputs(patterns: tuple[str, ...]) -> list[str]:
    """Every file the patterns match, sorted, deduplicated; a clear error for one matching none."""
    files: set[str] = set()
    for pattern in patterns:
        try:
            metadata = FileSystems.match([pattern])[0].metadata_list
        except Exception as error:  # Beam raises BeamIOError or IOError depending on the filesystem
            raise ValueError(f"--input {pattern!r}: cannot list it ({error})") from error
        matched = [m.path for m in metadata if not os.path.isdir(m.path)]
        if not matched:
            raise ValueError(f"--input {pattern!r} matches no file")
        files.update(matched)
    return sorted(files)


def _read_bytes(path: str) -> bytes:
    try:
        with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            return f.read()
    except Exception as error:
        raise ValueError(f"cannot read {path!r}: {error}") from error


def _summary(data_dir: str, seconds: float) -> dict[str, Any]:
    if "://" in data_dir:
        result = manifest.Manifest.from_dict(
            json.loads(_read_bytes(FileSystems.join(data_dir, manifest.MANIFEST_NAME)))
        )
    else:
        result = manifest.read_manifest(data_dir)
    return {
        "output": data_dir,
        "seconds": round(seconds, 2),
        **result.counts,
        "splits": {
            name: {
                "num_instances": s.num_instances,
                "num_documents": s.num_documents,
                "num_shards": len(s.shards),
            }
            for name, s in result.splits.items()
        },
    }


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the job; flags as `PrepareOptions` plus any Beam flags. Returns the manifest counts."""
    options = PipelineOptions(argv)
    standard = options.view_as(StandardOptions)
    if not standard.runner:
        standard.runner = "DirectRunner"  # Beam's default (Prism) downloads a binary: fails offline
    config = PrepareConfig.from_options(options)
    files = match_inputs(config.inputs)
    vocab_bytes = _read_bytes(config.vocab)
    logger.info(
        "prepare: %d input files -> %s (runner %s)", len(files), config.output, standard.runner
    )
    stale = FileSystems.join(config.output, manifest.MANIFEST_NAME)
    if FileSystems.exists(stale):
        FileSystems.delete([stale])  # the directory is incomplete until this run's manifest lands
    _warn_on_casing_mismatch(_parse_vocab(vocab_bytes), config.lower_case)
    start = time.monotonic()
    pipeline = beam.Pipeline(options=options)
    _ = pipeline | "PrepareDataset" >> PrepareDataset(config, files, vocab_bytes)
    try:
        result = pipeline.run()
        result.wait_until_finish()
    except Exception as error:
        if NO_DOCUMENTS_MESSAGE in str(error):
            # Beam wraps the DoFn's error (in another process with multi_processing): unwrap it.
            message = str(error)[str(error).index(NO_DOCUMENTS_MESSAGE) :].split("\n")[0]
            message = message.split(" [while running")[0]
            raise ValueError(message) from error
        raise
    summary = _summary(config.output, time.monotonic() - start)
    summary["metrics"] = _counters(result)
    logger.info("prepare: done in %.1f s: %s", summary["seconds"], summary)
    return summary


def _counters(result: beam.runners.runner.PipelineResult) -> dict[str, int]:
    """The job's Beam counters ({} where a runner reports none)."""
    try:
        query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    except (NotImplementedError, AttributeError):
        return {}
    counters = sorted(query["counters"], key=lambda c: c.key.metric.name)
    return {
        c.key.metric.name: c.committed if c.committed is not None else c.attempted for c in counters
    }


def _warn_on_casing_mismatch(vocab: dict[str, int], lower_case: bool) -> None:
    """An uncased vocab with --lower_case=false (or the reverse) silently maps words to [UNK]."""
    num_upper = sum(token[:1].isupper() for token in vocab if not token.startswith("["))
    if lower_case and num_upper > 0.05 * len(vocab):
        logger.warning(
            "--lower_case=true, but %d vocabulary entries are capitalized: a cased vocab?",
            num_upper,
        )
    if not lower_case and num_upper == 0:
        logger.warning(
            "--lower_case=false, but the vocabulary has no capitalized entry: an uncased vocab?"
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(json.dumps(run(sys.argv[1:]), indent=2))
