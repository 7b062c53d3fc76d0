"""Sentence splitting: paragraphs first, then blingfire inside each paragraph.

blingfire splits ~18 MB/s per core and knows abbreviations ("Dr.", "e.g."). It joins lines that
are not separated by a blank line, which is what wrapped prose needs, but it would also merge the
last sentence of one paragraph with a heading that follows it; splitting on blank lines first keeps
paragraph boundaries as hard sentence boundaries.
"""

from __future__ import annotations

import ctypes
import re
import threading

import blingfire

PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# blingfire does not end a sentence at the danda (U+0964) or double danda (U+0965), the full
# stop of Hindi, Marathi, Nepali, Bengali and Sanskrit: a whole paragraph came back as one
# sentence, and a document of such paragraphs was rejected as too_few_sentences. Cut after one
# where whitespace follows (a danda inside a token, as in a quoted verse number, stays).
DANDA_END = re.compile(r"(?<=[\u0964\u0965])\s+")


def split_paragraphs(text: str) -> list[str]:
    """Blocks separated by one or more blank (or whitespace-only) lines, stripped, no empties."""
    return [block.strip() for block in PARAGRAPH_BREAK.split(text) if block.strip()]


class _SentenceSplitter(threading.local):
    """`blingfire.text_to_sentences` with an output buffer kept between calls (one per thread).

    blingfire's own wrapper allocates and zero-fills a new buffer of twice the input per call,
    which cost more than the splitting itself on paragraph-sized inputs.
    """

    def __init__(self):
        self._buffer = ctypes.create_string_buffer(1 << 16)

    def __call__(self, text: str) -> str:
        data = text.encode("utf-8")
        if len(self._buffer) < 2 * len(data):  # blingfire's bound on the output size
            self._buffer = ctypes.create_string_buffer(2 * len(data))
        size = len(self._buffer)
        length = blingfire.blingfire.TextToSentences(
            ctypes.c_char_p(data), ctypes.c_int(len(data)), ctypes.byref(self._buffer),
            ctypes.c_int(size),
        )  # fmt: skip
        if length == -1 or length > size:
            return ""  # what blingfire's wrapper returns on failure
        # The output ends at its NUL terminator (as `buffer.value` reads it in blingfire's wrapper).
        return self._buffer.raw[:length].split(b"\0", 1)[0].decode("utf-8")


_text_to_sentences = _SentenceSplitter()


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` in order, each stripped, none empty."""
    sentences: list[str] = []
    for paragraph in split_paragraphs(text):
        for line in _text_to_sentences(paragraph).split("\n"):
            for sentence in DANDA_END.split(line):
                sentence = sentence.strip()
                if sentence:
                    sentences.append(sentence)
    return sentences


# ~2,000 WordPiece tokens: four times a 512-token instance, so only degenerate text (a table
# dumped as one line, a 50 MB line without punctuation) is cut, and tokenizing stays cheap.
MAX_SENTENCE_CHARS = 10_000


def bound_sentence_length(
    sentences: list[str] | tuple[str, ...], max_chars: int = MAX_SENTENCE_CHARS
) -> tuple[list[str], int]:
    """Sentences with every one longer than `max_chars` cut (at a space where there is one).

    Returns the pieces and how many sentences were cut. Without this bound, one 50 MB "sentence"
    becomes one 10-million-token encoding, gigabytes of memory in the tokenizer.
    """
    if all(len(s) <= max_chars for s in sentences):
        return list(sentences), 0
    bounded, num_cut = [], 0
    for sentence in sentences:
        if len(sentence) <= max_chars:
            bounded.append(sentence)
            continue
        num_cut += 1
        start = 0
        while start < len(sentence):
            end = min(start + max_chars, len(sentence))
            if end < len(sentence):
                space = sentence.rfind(" ", start + max_chars // 2, end)
                end = space if space > 0 else end
            piece = sentence[start:end].strip()
            if piece:
                bounded.append(piece)
            start = end
    return bounded, num_cut
