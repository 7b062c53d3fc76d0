"""Documents -> sentence-pair instances: the heart of the preparation job.

- sentences split and tokenized (`tokenize_transform`: long documents in parts, in parallel),
  documents with fewer than two sentences dropped, exact duplicates (same sentences) kept once
  (the smallest doc_id), doc_id collisions resolved;
- each document goes to `validation` when `unit_interval(seed, "split", doc_id)` is below the
  validation fraction, so no document contributes to both splits;
- random-B pools: a document joins pool `stable_hash(seed, "pool", doc_id) % num_pools` of its
  split, `num_pools = max(ceil(num_documents / random_pool_size), ceil(num_chars /
  random_pool_chars))` over the split, but never more than one pool per
  `MIN_DOCUMENTS_PER_POOL` documents. A pool is a uniform random sample of the whole split (not a
  contiguous range of the input, as NVIDIA's LDDL bins are), so a random B is drawn from anywhere
  in the corpus while a worker holds only one pool in memory. Both bounds matter: 512 books are
  hundreds of MB of text, so a count of documents alone lets a pool grow with the corpus; the
  floor keeps a document from being alone in its pool, where it could draw no random B.
"""

from __future__ import annotations

import hashlib
import logging
import math
from array import array
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.pvalue import AsDict

from bertforge.pipelines.beam_common import INSTANCES, RANDOM_NEXT, REJECTS, count, reject
from bertforge.pipelines.contract.tokenization import parse_vocab
from bertforge.pipelines.instances.batch_columns import InstanceBatch
from bertforge.pipelines.instances.pairing import (
    NEXT_IS_RANDOM,
    create_instances_from_document,
    document_rng,
    stable_hash,
    stable_hash_encoding,
    unit_interval,
)
from bertforge.pipelines.instances.tokenize_transform import Doc, TokenizeDocuments
from bertforge.pipelines.prepare_options import PrepareConfig
from bertforge.pipelines.write import global_order

logger = logging.getLogger(__name__)

# Rows per `InstanceBatch` a pool yields: ~8 MB of ids at 128 tokens.
ROWS_PER_INSTANCE_BATCH = 32_768


def sentences_of(doc: Doc, typecode: str) -> list[array]:
    """The token ids of each non-empty sentence of `doc`."""
    ids = array(typecode)
    ids.frombytes(doc.ids)
    lengths = array("i")
    lengths.frombytes(doc.sentence_lengths)
    sentences, start = [], 0
    for length in lengths:
        sentences.append(ids[start : start + length])
        start += length
    return sentences


def keep_first_copy(item: tuple[str, Any]):
    """Of documents with identical sentences keep the smallest doc_id; reject the others."""
    _, copies = item
    copies = sorted(copies, key=lambda d: (d.doc_id, d.source))
    yield copies[0]
    for doc in copies[1:]:
        yield reject(
            "duplicate_document", doc.source, doc.doc_id, f"same text as {copies[0].doc_id}"
        )


def colliding_ids(item: tuple[str, Any]):
    """(doc_id, text hash kept) for a doc_id that names different texts (set by the input)."""
    doc_id, hashes = item
    hashes = sorted(set(hashes))
    if len(hashes) > 1:
        yield doc_id, hashes[0]


def loses_id_collision(doc_id: str, text_hash: str, collisions: dict[str, str]) -> bool:
    """Whether another text keeps `doc_id` (see `colliding_ids`)."""
    kept_hash = collisions.get(doc_id)
    return kept_hash is not None and text_hash != kept_hash


def split_of(seed: int, doc_id: str, validation_fraction: float) -> str:
    return "validation" if unit_interval(seed, "split", doc_id) < validation_fraction else "train"


# Documents a pool holds at least on average. A document alone in its pool has no other to
# draw a random B from, and every pair it makes is a real next: with pools of ~4 documents
# (1 MB books at 4 MB a pool) that is e^-4, 1.8 % of the books; at 16, about one in 10 million.
MIN_DOCUMENTS_PER_POOL = 16


def num_pools(
    num_documents: int, random_pool_size: int, num_chars: int = 0, random_pool_chars: int = 1
) -> int:
    by_documents = math.ceil(num_documents / random_pool_size)
    bounded = max(by_documents, math.ceil(num_chars / random_pool_chars))
    return max(1, min(bounded, num_documents // MIN_DOCUMENTS_PER_POOL))


def pool_of(
    seed: int,
    doc_id: str,
    num_documents: int,
    random_pool_size: int,
    num_chars: int = 0,
    random_pool_chars: int = 1,
) -> int:
    pools = num_pools(num_documents, random_pool_size, num_chars, random_pool_chars)
    return stable_hash(seed, "pool", doc_id) % pools


def key_by_pool(doc: Doc, collisions: dict, split_sizes: dict, config: PrepareConfig):
    """A deduplicated document -> ((split, pool), doc), or the reject of a doc_id collision.

    split_sizes: {split: (num_documents, num_chars)} over the documents kept.
    """
    if loses_id_collision(doc.doc_id, doc.text_hash, collisions):
        yield reject("duplicate_doc_id", doc.source, doc.doc_id, "another text has this doc_id")
        return
    count("documents")
    count("sentences", doc.num_sentences)
    split = split_of(config.seed, doc.doc_id, config.validation_fraction)
    num_documents, num_chars = split_sizes[split]
    pool = pool_of(
        config.seed,
        doc.doc_id,
        num_documents,
        config.random_pool_size,
        num_chars,
        config.random_pool_chars,
    )
    yield (split, pool), doc


# --------------------------------------------------------------------------- instances


class CreateInstancesFromPool(beam.DoFn):
    """((split, pool), documents) -> `InstanceBatch`es of the pool's instances.

    A row's sort key starts with `stable_hash(seed, "order", doc_id, dupe, number)`: a uniform
    shuffle that any worker computes the same way (see `pipelines.write.global_order`).
    """

    def __init__(self, config: PrepareConfig, vocab: dict[str, int]):
        self._config = config
        self._cls_id, self._sep_id = vocab["[CLS]"], vocab["[SEP]"]
        self._dtype = global_order.id_dtype(len(vocab))
        self._typecode = "H" if self._dtype == np.uint16 else "i"

    def process(self, item: tuple[tuple[str, int], Any]):
        (split, pool), docs = item
        docs = sorted(docs, key=lambda d: d.doc_id)  # the pool's order must not depend on workers
        token_docs = [sentences_of(doc, self._typecode) for doc in docs]
        columns = _BatchColumns(split, self._typecode)
        num_instances = num_random_next = 0
        for dupe in range(self._config.dupe_factor):
            for index, doc in enumerate(docs):
                order_keys = OrderKeys(self._config.seed, doc.doc_id, dupe)
                instances = self._instances(index, doc.doc_id, dupe, token_docs)
                for number, instance in enumerate(instances):
                    columns.add(order_keys(number), doc.doc_id, dupe, number, instance)
                num_instances += len(instances)
                num_random_next += sum(instance.next_sentence_label == NEXT_IS_RANDOM
                                       for instance in instances)
                if len(columns) >= ROWS_PER_INSTANCE_BATCH:
                    yield columns.flush(self._dtype)
        if len(columns):
            yield columns.flush(self._dtype)
        count(INSTANCES, num_instances)
        count(RANDOM_NEXT, num_random_next)
        logger.debug(  # one per ~500 documents: the progress line says it for a console
            "pool %s/%d: %d documents -> %d instances", split, pool, len(docs), num_instances
        )

    def _instances(self, index: int, doc_id: str, dupe: int, token_docs: list[list[array]]):
        return create_instances_from_document(
            index,
            token_docs,
            max_seq_length=self._config.max_seq_length,
            short_seq_prob=self._config.short_seq_prob,
            rng=document_rng(self._config.seed, doc_id, dupe),
            cls_id=self._cls_id,
            sep_id=self._sep_id,
        )


class OrderKeys:
    """`stable_hash(seed, "order", doc_id, dupe, number)` for successive numbers, cheaply.

    The JSON encoding `stable_hash` hashes is a prefix shared by the document's instances plus the
    number, so the prefix is encoded once: the same 64-bit keys at a fraction of the cost.
    """

    def __init__(self, seed: int, doc_id: str, dupe: int):
        prefix = stable_hash_encoding(seed, "order", doc_id, dupe)
        self._prefix = prefix[:-1] + b","  # drop the closing "]"

    def __call__(self, number: int) -> int:
        encoded = self._prefix + str(number).encode() + b"]"
        return int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "big")


class _BatchColumns:
    """Instances of one split gathered column by column, flushed as `InstanceBatch`es."""

    def __init__(self, split: str, typecode: str):
        self._split = split
        self._typecode = typecode
        self._clear()

    def _clear(self) -> None:
        self._order_keys: list[int] = []
        self._doc_ids: list[str] = []
        self._dupes, self._numbers = array("i"), array("i")
        self._ids, self._lengths = array(self._typecode), array("i")
        self._num_a, self._labels = array("H"), array("b")

    def __len__(self) -> int:
        return len(self._order_keys)

    def add(self, order_key: int, doc_id: str, dupe: int, number: int, instance) -> None:
        self._order_keys.append(order_key)
        self._doc_ids.append(doc_id)
        self._dupes.append(dupe)
        self._numbers.append(number)
        self._ids.extend(instance.input_ids)
        self._lengths.append(len(instance.input_ids))
        self._num_a.append(instance.num_a_tokens)
        self._labels.append(instance.next_sentence_label)

    def flush(self, dtype: np.dtype) -> InstanceBatch:
        batch = InstanceBatch(
            self._split,
            np.array(self._order_keys, dtype=np.uint64),
            tuple(self._doc_ids),
            np.frombuffer(self._dupes, dtype=np.int32).copy(),
            np.frombuffer(self._numbers, dtype=np.int32).copy(),
            np.frombuffer(self._ids, dtype=dtype).copy(),
            np.frombuffer(self._lengths, dtype=np.int32).copy(),
            np.frombuffer(self._num_a, dtype=np.uint16).copy(),
            np.frombuffer(self._labels, dtype=np.int8).copy(),
        )
        self._clear()
        return batch


def _sum_pairs(pairs) -> tuple[int, int]:
    pairs = list(pairs)
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


class CreatePretrainingInstances(beam.PTransform):
    """Raw documents -> {"instances", "rejects", "document_stats"}.

    instances: `InstanceBatch`es (a pool's instances, as columns);
    document_stats: one dict {split: (num_documents, num_sentences)}.
    """

    def __init__(self, config: PrepareConfig, vocab_bytes: bytes):
        super().__init__()
        self._config = config
        self._vocab_bytes = vocab_bytes

    def expand(self, raw_documents):
        config = self._config
        split = raw_documents | "TokenizeDocuments" >> TokenizeDocuments(
            self._vocab_bytes, config.lower_case
        )
        unique = (
            split["docs"]
            | "KeyByText" >> beam.Map(lambda d: (d.text_hash, d))
            | "GroupSameText" >> beam.GroupByKey()
            | "KeepFirstCopy" >> beam.FlatMap(keep_first_copy).with_outputs(REJECTS, main="docs")
        )
        # Decisions that need the whole corpus (doc_id collisions, split sizes) are made on
        # small keys; the documents themselves then take one pass to their pools.
        doc_keys = unique.docs | "DocKeys" >> beam.Map(
            lambda d: (d.doc_id, d.text_hash, d.num_chars, d.num_sentences)
        )
        collisions = (
            doc_keys
            | "KeyById" >> beam.Map(lambda k: (k[0], k[1]))
            | "GroupSameId" >> beam.GroupByKey()
            | "CollidingIds" >> beam.FlatMap(colliding_ids)
        )
        kept_keys = doc_keys | "KeptKeys" >> beam.FlatMap(
            lambda k, collisions: [] if loses_id_collision(k[0], k[1], collisions) else [k],
            AsDict(collisions),
        )
        by_split = kept_keys | "AssignSplit" >> beam.Map(
            lambda k: (split_of(config.seed, k[0], config.validation_fraction), k)
        )
        split_sizes = (
            by_split
            | "DocChars" >> beam.MapTuple(lambda s, k: (s, (1, k[2])))
            | "SizePerSplit" >> beam.CombinePerKey(_sum_pairs)
        )
        document_stats = (
            by_split
            | "DocSentences" >> beam.MapTuple(lambda s, k: (s, (1, k[3])))
            | "SumPerSplit" >> beam.CombinePerKey(_sum_pairs)
            | "StatsDict" >> beam.combiners.ToDict()
        )
        pooled = unique.docs | "AssignPool" >> beam.FlatMap(
            key_by_pool, AsDict(collisions), AsDict(split_sizes), config
        ).with_outputs(REJECTS, main="docs")
        instances = (
            pooled.docs
            | "GroupPools" >> beam.GroupByKey()
            | "CreateInstances"
            >> beam.ParDo(CreateInstancesFromPool(config, parse_vocab(self._vocab_bytes)))
        )
        rejects = (
            split[REJECTS],
            unique[REJECTS],
            pooled[REJECTS],
        ) | "FlattenRejects" >> beam.Flatten()
        return {
            "instances": instances,
            "rejects": rejects,
            "document_stats": document_stats,
        }
