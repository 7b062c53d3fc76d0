"""Sentence-pair instances for next-sentence prediction, as Google's `create_pretraining_data.py`.

Pure functions on token ids: the Beam job (`pipelines/prepare.py`) only groups documents and feeds
them in. Faithful to Google in every draw that shapes the data (target length, chunking, split
point, random next with p = 0.5, unused sentences put back, truncation from a random end), with
one bug fixed: when no *other* document can be drawn for a "random" B, Google labels a B from the
same document as random; here the pair falls back to the real next segment (label 0), or is
skipped when the chunk has a single sentence.

Every random draw comes from a `random.Random` seeded by `stable_hash`, never Python's `hash()`
(salted per process), so the output is a function of (seed, document id) on any machine.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import NamedTuple

# Token ids of one sentence, no special tokens: a list, or a compact `array` (the Beam job's).
Sentence = list[int]
Document = list[Sentence]

NEXT_IS_REAL = 0  # Google and Hugging Face: 0 = B follows A, 1 = B is random
NEXT_IS_RANDOM = 1
RANDOM_NEXT_PROB = 0.5
# Google retries this often to draw a document other than the current one.
MAX_RANDOM_DOCUMENT_TRIES = 10

# The shortest instance: [CLS] A [SEP] B [SEP] with one token on each side.
MIN_SEQ_LENGTH = 5
# The longest the shards hold: `num_a_tokens` is a uint16 (DESIGN.md, the data contract). A
# longer one was taken and failed after all the tokenizing, with an OverflowError.
MAX_SEQ_LENGTH = 65_535


def check_max_seq_length(max_seq_length: int) -> None:
    """The one validation of a length, the job's config's and this module's callers'."""
    if max_seq_length < MIN_SEQ_LENGTH:
        raise ValueError(f"max_seq_length must be at least {MIN_SEQ_LENGTH} ([CLS] A [SEP] B "
                         f"[SEP]), got {max_seq_length}")
    if max_seq_length > MAX_SEQ_LENGTH:
        raise ValueError(f"max_seq_length must be at most {MAX_SEQ_LENGTH:,} (the shards' "
                         f"num_a_tokens is a uint16), got {max_seq_length:,}")


class Instance(NamedTuple):
    input_ids: list[int]  # [CLS] A [SEP] B [SEP], no padding; the type of the sentences given
    num_a_tokens: int  # len([CLS] A [SEP]) = len(A) + 2
    next_sentence_label: int  # NEXT_IS_REAL or NEXT_IS_RANDOM


def stable_hash(*parts: str | int) -> int:
    """A 64-bit hash of `parts`, identical in every process, machine and Python version.

    JSON encoding keeps ("a", "bc") and ("ab", "c") apart, and 1 apart from "1".
    """
    return int.from_bytes(
        hashlib.blake2b(stable_hash_encoding(*parts), digest_size=8).digest(), "big"
    )


def stable_hash_encoding(*parts: str | int) -> bytes:
    """The bytes `stable_hash` hashes: `parts` as a compact JSON array."""
    return json.dumps(parts, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def unit_interval(*parts: str | int) -> float:
    """`stable_hash` mapped to [0, 1): a reproducible coin for split and sampling decisions."""
    return stable_hash(*parts) / 2.0**64


def document_rng(seed: int, doc_id: str, dupe_index: int) -> random.Random:
    """The generator for one pass (`dupe_index`) over one document."""
    return random.Random(stable_hash(seed, "instances", doc_id, dupe_index))


def truncate_seq_pair(
    tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random
) -> None:
    """Trim the longer segment, one token at a time from a random end, until the pair fits.

    In place, with Google's draws (one `rng.random()` per removed token): removing from both ends
    avoids always cutting sentence endings. Ends are tracked as indices and sliced once, so a
    pathological 100k-token "sentence" costs O(n), not O(n^2) `del tokens[0]`s.
    """
    length_a, length_b = len(tokens_a), len(tokens_b)
    excess = length_a + length_b - max_num_tokens
    if excess <= 0:
        return
    # Which side each removal hits does not depend on the draws: Google's loop trims the longer
    # side (B on a tie) until the two are equal, then alternates B, A, B, ... So the draws are
    # made in one go, in Google's order, and each side counts its front cuts (draw < 0.5).
    draws = [rng.random() for _ in range(excess)]
    num_first = min(abs(length_a - length_b), excess)  # removals from the longer side first
    first, rest = draws[:num_first], draws[num_first:]
    cuts_a, cuts_b = rest[1::2], rest[0::2]  # after equal lengths: B first
    if length_a > length_b:
        cuts_a = first + cuts_a
    else:
        cuts_b = first + cuts_b
    front_a = sum(1 for draw in cuts_a if draw < 0.5)
    front_b = sum(1 for draw in cuts_b if draw < 0.5)
    back_a, back_b = len(cuts_a) - front_a, len(cuts_b) - front_b
    assert length_b - len(cuts_b) >= 0 and length_a - len(cuts_a) >= 0
    if front_a or back_a:
        tokens_a[:] = tokens_a[front_a : len(tokens_a) - back_a]
    if front_b or back_b:
        tokens_b[:] = tokens_b[front_b : len(tokens_b) - back_b]


def _draw_other_document(doc_index: int, num_documents: int, rng: random.Random) -> int | None:
    """Google's draw of a random document index; None when all tries hit `doc_index`."""
    for _ in range(MAX_RANDOM_DOCUMENT_TRIES):
        random_index = rng.randint(0, num_documents - 1)
        if random_index != doc_index:
            return random_index
    return None


def _random_segment(document: Document, target_length: int, rng: random.Random) -> list[int]:
    """Sentences of `document` from a random start until `target_length` tokens are gathered."""
    random_start = rng.randint(0, len(document) - 1)
    tokens = _empty_like(document[0])
    # By index: `document[random_start:]` would copy the rest of a book's sentence list (thousands
    # of references) for the two or three sentences a segment takes.
    for index in range(random_start, len(document)):
        tokens += document[index]
        if len(tokens) >= target_length:
            break
    return tokens


def _build_instance(
    tokens_a: list[int], tokens_b: list[int], label: int, cls_id: int, sep_id: int
) -> Instance:
    input_ids = _empty_like(tokens_a)
    input_ids.append(cls_id)
    input_ids += tokens_a
    input_ids.append(sep_id)
    input_ids += tokens_b
    input_ids.append(sep_id)
    return Instance(input_ids, len(tokens_a) + 2, label)


def _empty_like(tokens: Sequence[int]) -> Sequence[int]:
    """An empty sequence of the type of `tokens`: sentences may be lists or compact `array`s,
    and gathering arrays into an array copies memory instead of creating an int per token."""
    return tokens[:0]


def _concat(sentences: list[Sentence]) -> Sequence[int]:
    tokens = _empty_like(sentences[0])
    for sentence in sentences:
        tokens += sentence
    return tokens


def create_instances_from_document(
    doc_index: int,
    documents: list[Document],
    *,
    max_seq_length: int,
    short_seq_prob: float,
    rng: random.Random,
    cls_id: int,
    sep_id: int,
) -> list[Instance]:
    """All instances of `documents[doc_index]`; random B segments come from the other documents.

    Sentences must be non-empty. `documents` is the pool random segments are drawn from.
    """
    check_max_seq_length(max_seq_length)  # the job's config checked it; this, direct callers
    document = documents[doc_index]
    # [CLS], [SEP], [SEP]: 128 - 3 = 125 tokens of text at max_seq_length 128.
    max_num_tokens = max_seq_length - 3
    # Mostly fill the sequence, but sometimes train on short ones to close the gap between
    # pretraining and fine-tuning on short inputs (Google's comment, same draw).
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)

    instances: list[Instance] = []
    current_chunk: list[Sentence] = []
    current_length = 0
    i = 0
    while i < len(document):
        current_chunk.append(document[i])
        current_length += len(document[i])
        if i == len(document) - 1 or current_length >= target_seq_length:
            pair = _pair_from_chunk(current_chunk, doc_index, documents, target_seq_length, rng)
            if pair is not None:
                tokens_a, tokens_b, label, num_unused_segments = pair
                # Sentences after the split point were not used: the next chunk starts there.
                i -= num_unused_segments
                truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                assert tokens_a and tokens_b
                instances.append(_build_instance(tokens_a, tokens_b, label, cls_id, sep_id))
            current_chunk = []
            current_length = 0
        i += 1
    return instances


def _pair_from_chunk(
    chunk: list[Sentence],
    doc_index: int,
    documents: list[Document],
    target_seq_length: int,
    rng: random.Random,
) -> tuple[list[int], list[int], int, int] | None:
    """(tokens_a, tokens_b, label, num_unused_segments) for one chunk, or None to skip it."""
    a_end = 1
    if len(chunk) >= 2:
        a_end = rng.randint(1, len(chunk) - 1)
    tokens_a = _concat(chunk[:a_end])

    if len(chunk) == 1 or rng.random() < RANDOM_NEXT_PROB:
        random_index = _draw_other_document(doc_index, len(documents), rng)
        if random_index is not None:
            target_b_length = target_seq_length - len(tokens_a)
            tokens_b = _random_segment(documents[random_index], target_b_length, rng)
            return tokens_a, tokens_b, NEXT_IS_RANDOM, len(chunk) - a_end
        if len(chunk) == 1:
            return None  # no other document and no real next segment in this chunk
        # No other document could be drawn: Google would label a same-document B "random".
    tokens_b = _concat(chunk[a_end:])
    return tokens_a, tokens_b, NEXT_IS_REAL, 0
