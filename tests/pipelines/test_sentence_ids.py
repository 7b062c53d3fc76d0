"""Sentences encoded many per call (joined at a marker) give exactly the one-by-one ids."""

import numpy as np
import pytest

from bertforge.pipelines.contract.tokenization import load_tokenizer, read_vocab
from bertforge.pipelines.instances import sentence_ids
from bertforge.pipelines.instances.sentence_ids import MARKER, SentenceTokenizer
from bertforge.pipelines.instances.sentences import bound_sentence_length, split_sentences
from bertforge.pipelines.read.input_files import open_local, read_file
from bertforge.pipelines.read.records import RawDocument
from tests.pipelines.conftest import shared_data_file

TRICKY = [
    "Plain words, with punctuation!",
    "\x00\x01\x7f",  # control characters only: nothing after normalization
    "",
    "   ",
    "\u0301starts with a combining accent; Café naïve ÅNGSTRÖM",
    "ΟΔΟΣ ΣΟΦΟΣ ends in a capital sigma ΟΔΟΣ",
    "İstanbul ǅemal ﬁnance Straße",  # lower-casing that changes the length
    "中文字符和日本語のテキスト mixed with English",
    "a" * 101 + " is over the 100-character word limit, " + "b" * 100 + " is not",
    "zzzzqqqqxxxx unknown-ish wordpieces ☃ 🎉 \u200b zero width",
    "tab\there\r\nand\u2028line separators\u00a0nbsp",
    "[SEP] [CLS] [UNK] [MASK] look like special tokens",
    "[UNK]",
]


def _one_by_one(
    vocab_path: str, sentences: list[str], lower_case: bool = True
) -> tuple[list[int], list[int]]:
    tokenizer = load_tokenizer(vocab_path, lower_case=lower_case)
    per_sentence = [tokenizer.encode(s, add_special_tokens=False).ids for s in sentences]
    per_sentence = [ids for ids in per_sentence if ids]
    return [i for ids in per_sentence for i in ids], [len(ids) for ids in per_sentence]


def _check(vocab_path: str, sentences: list[str], lower_case: bool = True) -> None:
    ids, lengths = SentenceTokenizer(read_vocab(vocab_path), lower_case=lower_case)(sentences)
    expected_ids, expected_lengths = _one_by_one(vocab_path, sentences, lower_case)
    assert ids.dtype == np.uint16 and lengths.dtype == np.int32
    assert ids.tolist() == expected_ids
    assert lengths.tolist() == expected_lengths


def test_tricky_sentences_give_the_one_by_one_ids(small_vocab):
    _check(small_vocab, TRICKY * 3)


# Every ASCII character, alone, between letters and next to punctuation and spaces: the ASCII
# sentences are normalized in Python (control characters, tab/CR/LF, case), not by the tokenizer.
EVERY_ASCII = [f"{c}" for c in map(chr, range(128))] + [
    f"Ab{c}Cd {c} e{c}{c}F, g.{c}" for c in map(chr, range(128))
]


@pytest.mark.parametrize("lower_case", [True, False])
def test_every_ascii_character_gives_the_one_by_one_ids(small_vocab, lower_case):
    _check(small_vocab, EVERY_ASCII, lower_case)
    # ASCII and not ASCII interleaved: encoded apart, then put back in order.
    mixed = [s for pair in zip(EVERY_ASCII, TRICKY * 20, strict=False) for s in pair]
    _check(small_vocab, mixed, lower_case)
    _check(small_vocab, TRICKY + EVERY_ASCII[::-1], lower_case)


def test_text_holding_the_marker_is_encoded_one_by_one(small_vocab, monkeypatch):
    sentences = ["before the marker", f"a{MARKER}b holds it", "after it", "\x00"]
    _check(small_vocab, sentences)
    monkeypatch.setattr(sentence_ids, "GROUP_CHARS", 10)  # several groups, one with the marker
    _check(small_vocab, sentences * 5)


def test_groups_and_calls_do_not_change_the_ids(small_vocab, monkeypatch):
    sentences = [f"sentence number {i} of many, {'word ' * (i % 13)}" for i in range(500)]
    monkeypatch.setattr(sentence_ids, "GROUP_CHARS", 100)
    monkeypatch.setattr(sentence_ids, "GROUPS_PER_CALL", 3)
    _check(small_vocab, sentences + TRICKY)


def test_a_vocabulary_saved_with_a_byte_order_mark_reads_as_without(small_vocab, tmp_path):
    """An editor that writes a BOM: it is no part of `[PAD]` (which would then be missing)."""
    with open(small_vocab, "rb") as f:
        data = f.read()
    (tmp_path / "vocab.txt").write_bytes(b"\xef\xbb\xbf" + data)
    assert read_vocab(str(tmp_path / "vocab.txt")) == read_vocab(small_vocab)


def test_no_sentences(small_vocab):
    ids, lengths = SentenceTokenizer(read_vocab(small_vocab), lower_case=True)([])
    assert ids.size == 0 and lengths.size == 0


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("enwiki-wikibrain-en_test.xml.bz2", "wiki"),
        ("enwiki-pages-articles-sample.xml.bz2", "wiki"),
        ("enwiki-table-markup.xml.bz2", "wiki"),
        ("enwiki-20250201-tiny_dump.xml.bz2", "wiki"),
        ("chesterton-brown.txt", "books"),
        ("shakespeare-hamlet.txt", "books"),
    ],
)
def test_real_corpora_give_the_one_by_one_ids(name, fmt):
    """Google's uncased vocabulary on the real Wikipedia excerpts and books."""
    path = shared_data_file(name)
    vocab = shared_data_file("bert-base-uncased-vocab.txt")
    docs = [d for d in read_file(str(path), name, fmt, open_local) if isinstance(d, RawDocument)]
    sentences = [s for d in docs for s in split_sentences(d.text or "\n\n".join(d.sentences))]
    _check(str(vocab), bound_sentence_length(sentences)[0])
