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

ASCII sentences skip the tokenizer's normalizer, a third to a half of its time on English text:
Python normalizes them itself, exactly as `BertNormalizer` does ASCII (control characters
dropped, tab/newline/CR made spaces, lower-cased where the vocabulary is uncased; NFD and accent
stripping change nothing there), and a tokenizer without a normalizer encodes the result.
Sentences that are not pure ASCII go through the full tokenizer; the two kinds are put back in
order afterwards. Tested for every ASCII character and on the real corpora.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken

from bertforge.pipelines.contract.tokenization import tokenizer_from_vocab
from bertforge.pipelines.write import global_order

# A private-use character: no normalization produces it and real text almost never holds it.
MARKER = "\ue000"
# Characters joined into one tokenizer input: ~15,000 tokens, so a 50 MB document without
# paragraph breaks still never becomes one huge `Encoding`.
GROUP_CHARS = 65_536
# Joined groups per `encode_batch_fast` call (~2 MB of text).
GROUPS_PER_CALL = 32


# What `BertNormalizer(clean_text=True)` does to ASCII: control characters (C0 and DEL) are
# dropped, tab, newline and carriage return become spaces.
_ASCII_CONTROL = "".join(chr(c) for c in [*range(32), 127] if chr(c) not in "\t\n\r")
_ASCII_CLEAN = str.maketrans("\t\n\r", "   ", _ASCII_CONTROL)


class SentenceTokenizer:
    """`(ids, lengths)` of a list of sentences: the ids of the sentences that have any,
    concatenated, in `global_order.id_dtype(len(vocab))`, and int32 tokens per such sentence
    (sentences that normalize to nothing, e.g. control characters only, are left out)."""

    def __init__(self, vocab: dict[str, int], lower_case: bool):
        # The plain tokenizer encodes groups whose text holds the marker (the other would split
        # it out of the text).
        self._plain = tokenizer_from_vocab(vocab, lower_case)
        self._tokenizer = tokenizer_from_vocab(vocab, lower_case)
        self._tokenizer.add_special_tokens([AddedToken(MARKER, normalized=False, special=True)])
        self._marker_id = self._tokenizer.token_to_id(MARKER)
        # For ASCII sentences normalized here: the same tokenizer without its normalizer.
        self._ascii = tokenizer_from_vocab(vocab, lower_case)
        self._ascii.normalizer = None
        self._ascii.add_special_tokens([AddedToken(MARKER, normalized=False, special=True)])
        assert self._ascii.token_to_id(MARKER) == self._marker_id
        self._lower_case = lower_case
        self._dtype = global_order.id_dtype(len(vocab))

    def __call__(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        is_ascii = [sentence.isascii() for sentence in sentences]
        if all(is_ascii):
            ids, lengths = self._encode(self._ascii, list(map(self._normalize_ascii, sentences)))
        elif not any(is_ascii):
            ids, lengths = self._encode(self._tokenizer, sentences)
        else:
            ascii_ids, ascii_lengths = self._encode(
                self._ascii,
                [self._normalize_ascii(s) for s, a in zip(sentences, is_ascii, strict=True) if a],
            )
            other_ids, other_lengths = self._encode(
                self._tokenizer, [s for s, a in zip(sentences, is_ascii, strict=True) if not a]
            )
            ids, lengths = _interleave(
                np.array(is_ascii), ascii_ids, ascii_lengths, other_ids, other_lengths
            )
        return ids, lengths[lengths > 0]

    def _normalize_ascii(self, sentence: str) -> str:
        cleaned = sentence.translate(_ASCII_CLEAN)
        return cleaned.lower() if self._lower_case else cleaned

    def _encode(self, tokenizer, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, tokens per sentence, zeros included) of `sentences` through `tokenizer`."""
        groups = group_sentences(sentences, GROUP_CHARS)
        ids_parts: list[np.ndarray] = [np.zeros(0, self._dtype)]
        length_parts: list[np.ndarray] = [np.zeros(0, np.int32)]
        for start in range(0, len(groups), GROUPS_PER_CALL):
            batch = groups[start : start + GROUPS_PER_CALL]
            joined = [MARKER.join(group) + MARKER for group in batch]
            encodings = tokenizer.encode_batch_fast(joined, add_special_tokens=False)
            for group, text, encoding in zip(batch, joined, encodings, strict=True):
                if text.count(MARKER) == len(group):
                    ids, lengths = self._split_at_markers(encoding.ids)
                else:  # the text holds the marker itself: one sentence at a time
                    ids, lengths = self._one_by_one(group)
                ids_parts.append(ids)
                length_parts.append(lengths)
        return np.concatenate(ids_parts), np.concatenate(length_parts)

    def _split_at_markers(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        array = np.array(ids, dtype=np.int64)
        is_marker = array == self._marker_id
        lengths = np.diff(np.flatnonzero(is_marker), prepend=-1) - 1
        return array[~is_marker].astype(self._dtype), lengths.astype(np.int32)

    def _one_by_one(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # Only sentences that are not ASCII get here (an ASCII one cannot hold the marker).
        encodings = self._plain.encode_batch_fast(sentences, add_special_tokens=False)
        ids = [i for e in encodings for i in e.ids]
        return np.array(ids, dtype=self._dtype), np.array([len(e.ids) for e in encodings], np.int32)


def _interleave(
    is_first: np.ndarray,
    first_ids: np.ndarray,
    first_lengths: np.ndarray,
    second_ids: np.ndarray,
    second_lengths: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Two subsets' per-sentence ids put back in sentence order (`is_first`: which subset each
    sentence came from, in order)."""
    lengths = np.zeros(len(is_first), np.int32)
    lengths[is_first] = first_lengths
    lengths[~is_first] = second_lengths
    starts = np.zeros(len(is_first), np.int64)  # where each sentence's ids start in `joined`
    starts[is_first] = np.cumsum(first_lengths) - first_lengths
    starts[~is_first] = len(first_ids) + np.cumsum(second_lengths) - second_lengths
    joined = np.concatenate([first_ids, second_ids])
    # Concatenated ranges [starts[i], starts[i] + lengths[i]) without a loop over sentences.
    shift = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return joined[np.arange(lengths.sum()) + shift], lengths


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
