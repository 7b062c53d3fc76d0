"""Raw documents -> `Doc`s: sentences split and tokenized, in parallel even inside a long book.

Tokenizing is most of the job's work, so it must spread evenly over workers. A corpus mixes
Wikipedia articles of a few KB with books of a MB: spread whole, a few books land on one worker,
which then works alone while the others wait. So a document longer than `PART_CHARS` is cut into
parts at paragraph breaks (or between sentences, for input that is already one sentence a line),
the parts are spread and tokenized independently, and a long document's parts are put back
together in order. Sentence splitting treats a paragraph break as a hard boundary, so the parts'
sentences are exactly the document's (tested).

A document's `text_hash` (exact deduplication) hashes the digests of its sentences, so it is the
same whether it was tokenized whole or in parts.
"""

from __future__ import annotations

import hashlib
import logging
from typing import NamedTuple

import apache_beam as beam

from bertforge.pipelines.beam_common import (
    LOG_EVERY_DOCUMENTS,
    REJECTS,
    TOKENIZED_PIECES,
    UNKNOWN_PIECES,
    count,
    reject,
)
from bertforge.pipelines.contract.tokenization import UNKNOWN_TOKEN, parse_vocab
from bertforge.pipelines.instances.sentence_ids import SentenceTokenizer
from bertforge.pipelines.instances.sentences import (
    MAX_SENTENCE_CHARS,
    PARAGRAPH_BREAK,
    bound_sentence_length,
    split_sentences,
)
from bertforge.pipelines.read.records import RawDocument

logger = logging.getLogger(__name__)

# ~64 KB of text, about 15,000 tokens: most Wikipedia articles are one part, a book ~20. Smaller
# parts spread the work more evenly (a worker finishing 4 s after the other with 256 KB parts, on
# the 30x benchmark corpus); each part costs one more element in the reassembly grouping.
PART_CHARS = 65_536
SENTENCE_DIGEST_BYTES = 8
LENGTH_BYTES = 4  # a sentence's token count in `sentence_lengths`: int32


class Doc(NamedTuple):
    """A document split into sentences and tokenized: compact, so groupings move little data."""

    doc_id: str
    source: str
    text_hash: str  # of the sentences: equal texts are duplicates
    num_chars: int  # characters in its sentences: sizes the random-B pools
    num_sentences: int  # sentences after splitting, before empty ones are dropped: statistics
    ids: bytes  # token ids of its non-empty sentences, concatenated, in `shards.id_dtype`
    sentence_lengths: bytes  # int32 per non-empty sentence: tokens in it


class DocumentPart(NamedTuple):
    doc_id: str
    source: str
    record: str  # digest of the raw record: keeps apart two records with one doc_id and source
    part: int
    num_parts: int
    text: str | None  # free text, or
    sentences: tuple[str, ...] | None  # already one sentence per entry


class TokenizedPart(NamedTuple):
    doc_id: str
    source: str
    record: str
    part: int
    num_parts: int
    sentence_digests: bytes  # SENTENCE_DIGEST_BYTES per sentence
    num_chars: int
    num_cut: int  # over-long sentences cut
    ids: bytes
    sentence_lengths: bytes


def sentence_digest(sentence: str) -> bytes:
    return hashlib.blake2b(sentence.encode("utf-8"), digest_size=SENTENCE_DIGEST_BYTES).digest()


def text_hash(sentence_digests: bytes) -> str:
    return hashlib.blake2b(sentence_digests, digest_size=16).hexdigest()


def document_parts(raw: RawDocument, part_chars: int = PART_CHARS) -> list[DocumentPart]:
    """`raw` cut into parts of about `part_chars` characters at paragraph (or sentence) breaks."""
    content = "\n".join(raw.sentences) if raw.sentences is not None else raw.text or ""
    record = hashlib.blake2b(content.encode("utf-8"), digest_size=8).hexdigest()
    if raw.sentences is not None:
        chunks = _sentence_chunks(raw.sentences, part_chars)
        return [
            DocumentPart(raw.doc_id, raw.source, record, i, len(chunks), None, chunk)
            for i, chunk in enumerate(chunks)
        ]
    chunks = _text_chunks(raw.text or "", part_chars)
    return [
        DocumentPart(raw.doc_id, raw.source, record, i, len(chunks), chunk, None)
        for i, chunk in enumerate(chunks)
    ]


def _text_chunks(text: str, part_chars: int) -> list[str]:
    """Cut at paragraph breaks (`split_sentences` never joins across one), once a chunk is long
    enough; the breaks themselves are dropped, as paragraph splitting drops them."""
    if len(text) <= part_chars:
        return [text]
    chunks, start = [], 0
    for match in PARAGRAPH_BREAK.finditer(text):
        if match.start() - start >= part_chars:
            chunks.append(text[start : match.start()])
            start = match.end()
    chunks.append(text[start:])
    return chunks


def _sentence_chunks(sentences: tuple[str, ...], part_chars: int) -> list[tuple[str, ...]]:
    chunks: list[tuple[str, ...]] = []
    start = num_chars = 0
    for i, sentence in enumerate(sentences):
        num_chars += len(sentence)
        if num_chars >= part_chars:
            chunks.append(sentences[start : i + 1])
            start, num_chars = i + 1, 0
    if start < len(sentences) or not chunks:
        chunks.append(sentences[start:])
    return chunks


class TokenizeParts(beam.DoFn):
    """`DocumentPart` -> `TokenizedPart`. The vocabulary travels inside the DoFn as bytes."""

    def __init__(self, vocab_bytes: bytes, lower_case: bool):
        self._vocab_bytes = vocab_bytes
        self._lower_case = lower_case

    def setup(self) -> None:
        vocab = parse_vocab(self._vocab_bytes)
        self._tokenize = SentenceTokenizer(vocab, self._lower_case)
        self._unknown_id = vocab[UNKNOWN_TOKEN]
        self._num_seen = 0

    def process(self, part: DocumentPart):
        sentences, num_cut = bound_sentence_length(
            part.sentences if part.sentences is not None else split_sentences(part.text or "")
        )
        ids, lengths = self._tokenize(sentences)
        # How well the vocabulary fits the text (prepare warns of a poor fit after the job).
        count(TOKENIZED_PIECES, len(ids))
        count(UNKNOWN_PIECES, int((ids == self._unknown_id).sum()))
        self._num_seen += 1
        if self._num_seen % LOG_EVERY_DOCUMENTS == 0:
            logger.info("tokenized %d documents (or parts) in this worker", self._num_seen)
        yield TokenizedPart(
            part.doc_id,
            part.source,
            part.record,
            part.part,
            part.num_parts,
            b"".join(sentence_digest(sentence) for sentence in sentences),
            sum(len(sentence) for sentence in sentences),
            num_cut,
            ids.tobytes(),
            lengths.tobytes(),
        )


def assemble(parts: list[TokenizedPart]):
    """A record's tokenized parts (any order) -> its `Doc`, or the rejects that drop it.

    Byte-identical records (the same doc_id, source and text twice) share a key, so their parts
    arrive together: each copy is assembled, and deduplication drops all but one later, as for
    any other duplicate. Fewer than two sentences cannot make a pair.
    """
    parts = sorted(parts, key=lambda p: p.part)
    num_parts = parts[0].num_parts
    num_copies, left = divmod(len(parts), num_parts)
    assert left == 0 and [p.part for p in parts[::num_copies]] == list(range(num_parts)), (
        parts[0].doc_id,
        parts[0].source,
    )
    for copy in range(num_copies):
        yield from _assemble_one(parts[copy::num_copies])


def _assemble_one(parts: list[TokenizedPart]):
    first = parts[0]
    num_cut = sum(p.num_cut for p in parts)
    if num_cut:
        yield reject(
            "overlong_sentence",
            first.source,
            first.doc_id,
            f"{num_cut} sentences over {MAX_SENTENCE_CHARS} characters cut",
        )
    digests = b"".join(p.sentence_digests for p in parts)
    num_sentences = len(digests) // SENTENCE_DIGEST_BYTES
    lengths = b"".join(p.sentence_lengths for p in parts)
    if num_sentences == 0:
        yield reject("empty_document", first.source, first.doc_id)
    elif num_sentences < 2:
        yield reject("too_few_sentences", first.source, first.doc_id, "1 sentence")
    elif not lengths:
        yield reject("empty_after_tokenization", first.source, first.doc_id)
    elif len(lengths) < 2 * LENGTH_BYTES:
        # The others tokenized to nothing (U+FFFD, zero-width characters): one sentence left.
        yield reject("too_few_sentences", first.source, first.doc_id, "1 sentence with tokens")
    else:
        yield Doc(
            first.doc_id,
            first.source,
            text_hash(digests),
            sum(p.num_chars for p in parts),
            num_sentences,
            b"".join(p.ids for p in parts),
            lengths,
        )


class TokenizeDocuments(beam.PTransform):
    """Raw documents -> {"docs": Doc, REJECTS: Reject}."""

    def __init__(self, vocab_bytes: bytes, lower_case: bool, part_chars: int = PART_CHARS):
        super().__init__()
        self._vocab_bytes = vocab_bytes
        self._lower_case = lower_case
        self._part_chars = part_chars

    def expand(self, raw_documents):
        tokenized = (
            raw_documents
            | "CutIntoParts" >> beam.FlatMap(document_parts, self._part_chars)
            # One file yields many documents (and a book many parts): spread them before the
            # costly step, so every worker gets a share.
            | "SpreadParts" >> beam.Reshuffle()
            | "TokenizeParts" >> beam.ParDo(TokenizeParts(self._vocab_bytes, self._lower_case))
        )
        # Every document is grouped with its parts, not only those cut into several: a Flatten of
        # whole and reassembled documents would cost the local runner one more pass over all.
        docs = (
            tokenized
            | "KeyByRecord" >> beam.Map(lambda p: ((p.doc_id, p.source, p.record), p))
            | "GroupParts" >> beam.GroupByKey()
            | "Assemble"
            >> beam.FlatMap(lambda item: assemble(list(item[1]))).with_outputs(REJECTS, main="docs")
        )
        return {"docs": docs.docs, REJECTS: docs[REJECTS]}
