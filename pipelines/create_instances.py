"""Documents -> sentence-pair instances: the heart of the preparation job.

- sentences split, documents with fewer than two dropped, exact duplicates (same sentences) kept
  once (the smallest doc_id), doc_id collisions resolved;
- each document goes to `validation` when `unit_interval(seed, "split", doc_id)` is below the
  validation fraction, so no document contributes to both splits;
- random-B pools: a document joins pool `stable_hash(seed, "pool", doc_id) % num_pools` of its
  split, `num_pools = max(ceil(num_documents / random_pool_size), ceil(num_chars /
  random_pool_chars))` over the split. A pool is a uniform random sample of the whole split (not a
  contiguous range of the input, as NVIDIA's LDDL bins are), so a random B is drawn from anywhere
  in the corpus while a worker holds only one pool in memory. Both bounds matter: 512 books are
  hundreds of MB of text, so a count of documents alone lets a pool grow with the corpus.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
from array import array
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.pvalue import AsDict

from pipelines import shards
from pipelines.beam_common import LOG_EVERY_DOCUMENTS, REJECTS, count, reject
from pipelines.instances import (
    create_instances_from_document,
    document_rng,
    stable_hash,
    unit_interval,
)
from pipelines.prepare_options import PrepareConfig
from pipelines.records import RawDocument
from pipelines.sentences import MAX_SENTENCE_CHARS, bound_sentence_length, split_sentences
from pipelines.tokenization import load_tokenizer, read_vocab

logger = logging.getLogger(__name__)

# ~20,000 sentences (~2 MB of text) per `encode_batch`: large enough to amortize the call, small
# enough that the batch's Encoding objects stay a few tens of MB.
TOKENIZE_BATCH_SENTENCES = 20_000


class Doc(NamedTuple):
    doc_id: str
    source: str
    sentences: tuple[str, ...]
    text_hash: str


def text_hash(sentences: tuple[str, ...]) -> str:
    return hashlib.blake2b("\n".join(sentences).encode("utf-8"), digest_size=16).hexdigest()


class SplitSentences(beam.DoFn):
    """Raw document -> `Doc` with its sentences; fewer than two sentences cannot make a pair."""

    def setup(self) -> None:
        self._num_seen = 0

    def process(self, raw: RawDocument):
        sentences, num_cut = bound_sentence_length(
            raw.sentences if raw.sentences is not None else split_sentences(raw.text or "")
        )
        if num_cut:
            yield reject(
                "overlong_sentence",
                raw.source,
                raw.doc_id,
                f"{num_cut} sentences over {MAX_SENTENCE_CHARS} characters cut",
            )
        sentences = tuple(sentences)
        self._num_seen += 1
        if self._num_seen % LOG_EVERY_DOCUMENTS == 0:
            logger.info("split sentences of %d documents in this worker", self._num_seen)
        if not sentences:
            yield reject("empty_document", raw.source, raw.doc_id)
        elif len(sentences) < 2:
            yield reject("too_few_sentences", raw.source, raw.doc_id, f"{len(sentences)} sentence")
        else:
            yield Doc(raw.doc_id, raw.source, sentences, text_hash(sentences))


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


def drop_id_collisions(doc: Doc, collisions: dict[str, str]):
    kept_hash = collisions.get(doc.doc_id)
    if kept_hash is not None and doc.text_hash != kept_hash:
        yield reject("duplicate_doc_id", doc.source, doc.doc_id, "another text has this doc_id")
    else:
        yield doc


def split_of(seed: int, doc_id: str, validation_fraction: float) -> str:
    return "validation" if unit_interval(seed, "split", doc_id) < validation_fraction else "train"


def key_by_split(doc: Doc, seed: int, validation_fraction: float) -> tuple[str, Doc]:
    """The split of a document that survived every filter (counted here)."""
    count("documents")
    count("sentences", len(doc.sentences))
    return split_of(seed, doc.doc_id, validation_fraction), doc


def num_pools(
    num_documents: int, random_pool_size: int, num_chars: int = 0, random_pool_chars: int = 1
) -> int:
    by_documents = math.ceil(num_documents / random_pool_size)
    return max(1, by_documents, math.ceil(num_chars / random_pool_chars))


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


def num_chars_of(doc: Doc) -> int:
    return sum(len(sentence) for sentence in doc.sentences)


def key_by_pool(split_and_doc: tuple[str, Doc], split_sizes: dict, config: PrepareConfig):
    """split_sizes: {split: (num_documents, num_chars)}."""
    split, doc = split_and_doc
    num_documents, num_chars = split_sizes[split]
    pool = pool_of(
        config.seed,
        doc.doc_id,
        num_documents,
        config.random_pool_size,
        num_chars,
        config.random_pool_chars,
    )
    return (split, pool), doc


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
        self._typecode = "H" if self._dtype == np.uint16 else "i"

    def _tokenize(self, docs: list[Doc]) -> list[list[array]]:
        """Token ids per sentence per document, `encode_batch` on batches of sentences.

        Sentences that normalize to nothing (control characters only) are dropped. Ids are kept
        as compact arrays (2 bytes an id, not a 36-byte Python int and pointer), and a batch's
        `Encoding`s (tens of bytes a token: tokens, offsets, masks) are dropped before the next.
        """
        flat = [sentence for doc in docs for sentence in doc.sentences]
        ids: list[array] = []
        for start in range(0, len(flat), TOKENIZE_BATCH_SENTENCES):
            batch = flat[start : start + TOKENIZE_BATCH_SENTENCES]
            encodings = self._tokenizer.encode_batch(batch, add_special_tokens=False)
            ids.extend(array(self._typecode, e.ids) for e in encodings)
        tokenized, start = [], 0
        for doc in docs:
            tokenized.append([x for x in ids[start : start + len(doc.sentences)] if x])
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
                yield reject("empty_after_tokenization", doc.source, doc.doc_id)
        num_instances = 0
        for dupe in range(self._config.dupe_factor):
            for index, doc in enumerate(kept):
                instances = self._instances(index, doc.doc_id, dupe, token_docs)
                for number, instance in enumerate(instances):
                    num_instances += 1
                    yield split, self._sort_key(doc.doc_id, dupe, number), self._payload(instance)
        count("instances", num_instances)
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
        split_sizes = (
            by_split
            | "DocChars" >> beam.MapTuple(lambda s, d: (s, (1, num_chars_of(d))))
            | "SizePerSplit" >> beam.CombinePerKey(_sum_pairs)
        )
        document_stats = (
            by_split
            | "DocSentences" >> beam.MapTuple(lambda s, d: (s, (1, len(d.sentences))))
            | "SumPerSplit" >> beam.CombinePerKey(_sum_pairs)
            | "StatsDict" >> beam.combiners.ToDict()
        )
        instances = (
            by_split
            | "AssignPool" >> beam.Map(key_by_pool, AsDict(split_sizes), config)
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
