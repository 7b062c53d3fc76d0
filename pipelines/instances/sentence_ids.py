"""Sentences -> their WordPiece ids, many sentences per tokenizer call, exactly as one by one.

Encoding each sentence on its own costs the tokenizer a Python `Encoding` (tokens, offsets,
masks) per sentence and the job a list conversion per sentence: ~30 % of the tokenize step on
books. Here the sentences of a part are joined with a marker, a special token matched on the raw
text (`normalized=False`) and a string the text itself never holds (checked), and each joined
string is encoded once with `encode_batch_fast` (no offsets). The tokenizer splits its input at
added tokens *before* normalizing and pre-tokenizing, so every sentence between two markers is
normalized and tokenized alone, exactly as `encode(sentence)` would: the ids between markers are
that sentence's ids by construction, not by an argument about whitespace (tested against
one-by-one encoding on the real corpora). A group whose text does hold the marker is encoded
sentence by sentence instead.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken

from bertforge.pipelines.contract.tokenization import tokenizer_from_vocab
from bertforge.pipelines.write import shards

# A private-use character: no normalization produces it and real text almost never holds it.
MARKER = "\ue000"
# Characters joined into one tokenizer input: ~15,000 tokens, so a 50 MB document without
# paragraph breaks still never becomes one huge `Encoding`.
GROUP_CHARS = 65_536
# Joined groups per `encode_batch_fast` call (~2 MB of text).
GROUPS_PER_CALL = 32


class SentenceTokenizer:
    """`(ids, lengths)` of a list of sentences: the ids of the sentences that have any,
    concatenated, in `shards.id_dtype(len(vocab))`, and int32 tokens per such sentence
    (sentences that normalize to nothing, e.g. control characters only, are left out)."""

    def __init__(self, vocab: dict[str, int], lower_case: bool):
        # The plain tokenizer encodes groups whose text holds the marker (the other would split
        # it out of the text).
        self._plain = tokenizer_from_vocab(vocab, lower_case)
        self._tokenizer = tokenizer_from_vocab(vocab, lower_case)
        self._tokenizer.add_special_tokens([AddedToken(MARKER, normalized=False, special=True)])
        self._marker_id = self._tokenizer.token_to_id(MARKER)
        self._dtype = shards.id_dtype(len(vocab))

    def __call__(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        groups = group_sentences(sentences, GROUP_CHARS)
        ids_parts: list[np.ndarray] = []
        length_parts: list[np.ndarray] = []
        for start in range(0, len(groups), GROUPS_PER_CALL):
            batch = groups[start : start + GROUPS_PER_CALL]
            joined = [MARKER.join(group) + MARKER for group in batch]
            encodings = self._tokenizer.encode_batch_fast(joined, add_special_tokens=False)
            for group, text, encoding in zip(batch, joined, encodings, strict=True):
                if text.count(MARKER) == len(group):
                    ids, lengths = self._split_at_markers(encoding.ids)
                else:  # the text holds the marker itself: one sentence at a time
                    ids, lengths = self._one_by_one(group)
                ids_parts.append(ids)
                length_parts.append(lengths)
        if not ids_parts:
            return np.zeros(0, self._dtype), np.zeros(0, np.int32)
        return np.concatenate(ids_parts), np.concatenate(length_parts)

    def _split_at_markers(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        array = np.array(ids, dtype=np.int64)
        is_marker = array == self._marker_id
        lengths = np.diff(np.flatnonzero(is_marker), prepend=-1) - 1
        return array[~is_marker].astype(self._dtype), lengths[lengths > 0].astype(np.int32)

    def _one_by_one(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._plain.encode_batch_fast(sentences, add_special_tokens=False)
        per_sentence = [e.ids for e in encodings if e.ids]
        ids = [i for sentence in per_sentence for i in sentence]
        return np.array(ids, dtype=self._dtype), np.array(list(map(len, per_sentence)), np.int32)


def group_sentences(sentences: list[str], max_chars: int) -> list[list[str]]:
    """Consecutive sentences in groups of about `max_chars` (a longer sentence alone)."""
    groups: list[list[str]] = []
    current: list[str] = []
    num_chars = 0
    for sentence in sentences:
        if current and num_chars + len(sentence) > max_chars:
            groups.append(current)
            current, num_chars = [], 0
        current.append(sentence)
        num_chars += len(sentence) + 1
    if current:
        groups.append(current)
    return groups
