"""File-level reading: books, Parquet, and every kind of bad file counted, never silently lost."""

from __future__ import annotations

import bz2
import gzip
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from bertforge.pipelines.instances.sentences import bound_sentence_length, split_sentences
from bertforge.pipelines.read.input_files import open_local, read_file
from bertforge.pipelines.read.readers import format_of, split_format
from bertforge.pipelines.read.records import RawDocument, Reject

from .conftest import shared_data_file


def _read(path, fmt=None, prefix="p"):
    return list(read_file(str(path), prefix, fmt or format_of(str(path)), open_local))


def _reasons(items):
    return [i.reason for i in items if isinstance(i, Reject)]


def test_book_is_one_document_with_crlf_and_bom(tmp_path):
    path = tmp_path / "book.txt"
    text = "\ufeff[Title by Author]\r\n\r\nFirst line of a\r\nwrapped paragraph. Next one.\r\n"
    path.write_bytes(text.encode("utf-8"))
    (doc,) = _read(path, "books", prefix="book.txt")
    assert doc.doc_id == "book.txt" and "\r" not in doc.text and "\ufeff" not in doc.text
    assert split_sentences(doc.text) == [
        "[Title by Author]",
        "First line of a wrapped paragraph.",
        "Next one.",
    ]


def test_a_danda_ends_a_sentence_as_a_full_stop_does():
    """Hindi (and Marathi, Nepali, Bengali) end sentences with a danda, which blingfire does
    not split at: a Hindi document was one sentence, rejected as too_few_sentences."""
    hindi = "भारत एक देश है। यह बहुत बड़ा है॥ दिल्ली इसकी राजधानी है।"
    assert split_sentences(hindi) == ["भारत एक देश है।", "यह बहुत बड़ा है॥",
                                      "दिल्ली इसकी राजधानी है।"]
    # Mixed with English, and a danda with no space after it, are left as they were.
    assert split_sentences("He said: नमस्ते। Then he left. पद १।२") == [
        "He said: नमस्ते।", "Then he left.", "पद १।२"]


def test_real_crlf_book_reads_like_lf(tmp_path):
    path = shared_data_file("melville-moby_dick.txt")
    (doc,) = _read(path, "books")
    lf = tmp_path / "lf.txt"
    lf.write_bytes(path.read_bytes().replace(b"\r\n", b"\n"))
    assert _read(lf, "books")[0].text == doc.text
    assert len(split_sentences(doc.text)) > 5000


def test_format_prefixes_and_extensions():
    assert split_format("books:/d/*.txt") == ("books", "/d/*.txt")
    assert split_format("gs://b/x.jsonl") == (None, "gs://b/x.jsonl")
    assert format_of("a/wiki.xml.bz2") == "wiki" and format_of("x.parquet") == "parquet"
    assert format_of("b.txt") == "sentences" and format_of("b.txt", "books") == "books"


def test_parquet_rows_in_batches(tmp_path):
    path = tmp_path / "hf.parquet"
    texts = [f"Row {i} first sentence. Row {i} second." for i in range(3000)] + [""]
    table = pa.table({"id": [str(i) for i in range(3001)], "text": texts})
    pq.write_table(table, path, row_group_size=500)
    items = _read(path)
    docs = [i for i in items if isinstance(i, RawDocument)]
    assert len(docs) == 3000 and docs[7].doc_id == "p:7" and docs[7].text == texts[7]
    assert _reasons(items) == ["empty_document"]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    assert _reasons(_read(tmp_path / "bad.parquet")) == ["invalid_parquet"]


def test_bad_files_are_counted_by_reason(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 10)
    # 40,000 records (1.4 MB): two bz2 blocks of 900 kB, so the first survives the cut.
    good = "".join(json.dumps({"text": f"Doc {i}. Two sentences."}) + "\n" for i in range(40_000))
    (tmp_path / "cut.jsonl.bz2").write_bytes(bz2.compress(good.encode())[:-200])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(good.encode())[:-50])
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 one.\nCaf\xe9 two.\n".encode("latin-1"))
    assert _reasons(_read(tmp_path / "empty.txt")) == ["empty_file"]
    assert _reasons(_read(tmp_path / "blank.jsonl")) == ["empty_file"]
    assert _reasons(_read(tmp_path / "binary.txt")) == ["binary_file"]
    # UTF-16 was "binary_file" ("first bytes b'\xff\xfe[\x00E\x00m...'"): said for what it is.
    (tmp_path / "utf16.txt").write_bytes("Emma. A novel.\n".encode("utf-16"))
    (utf16,) = _read(tmp_path / "utf16.txt")
    assert utf16.reason == "utf16_file" and "convert it to UTF-8" in utf16.detail
    for name in ("cut.jsonl.bz2", "cut.jsonl.gz"):
        items = _read(tmp_path / name)
        assert _reasons(items) == ["truncated_compressed_file"], name
        assert 0 < sum(isinstance(i, RawDocument) for i in items) < 40_000  # what was read is kept
    items = _read(tmp_path / "latin1.txt")
    assert _reasons(items) == ["invalid_utf8"]  # a repair: the document is kept
    assert items[-1].sentences == ("Caf\ufffd one.", "Caf\ufffd two.")


def test_a_cut_small_dump_keeps_the_articles_before_the_cut(tmp_path):
    """The wiki reader asks for a megabyte at a time, and the call that met the cut lost all
    it had decompressed: a dump under ~1 MB kept 54 of its ~1,300 whole articles."""
    import zlib

    page = ("<page><title>T{0}</title><ns>0</ns><id>{0}</id><revision><text>Sentence one of "
            "article {0}. Sentence two here. And a third one.</text></revision></page>\n")
    xml = "<mediawiki>\n" + "".join(page.format(i) for i in range(1, 2000)) + "</mediawiki>\n"
    cut = gzip.compress(xml.encode())
    cut = cut[: len(cut) * 3 // 4]
    (tmp_path / "cut.xml.gz").write_bytes(cut)
    whole = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(cut).count(b"</page>")
    items = _read(tmp_path / "cut.xml.gz")
    assert "truncated_compressed_file" in _reasons(items)
    kept = sum(isinstance(i, RawDocument) for i in items)
    assert whole - 300 <= kept <= whole  # at most 64 KB (~290 articles here) lost at the cut


def test_overlong_sentences_are_cut():
    pieces, num_cut = bound_sentence_length(["short.", "word " * 5000], max_chars=1000)
    assert num_cut == 1 and pieces[0] == "short."
    assert all(len(p) <= 1000 for p in pieces) and len(pieces) > 25


def google_style_vocab(num_words: int = 3000) -> str:
    """Google's layout: [PAD], [unused0-98], [UNK], [CLS], [SEP], [MASK], then pieces."""
    specials = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]",
                "[MASK]"]
    words = [f"word{i}" if i % 3 else f"##piece{i}" for i in range(num_words)]
    return "\n".join(specials + words) + "\n"


def test_a_vocabulary_among_the_corpus_files_is_rejected_not_read_as_sentences(tmp_path):
    """A vocab.txt beside the corpus files was read as one document of 8,000 "sentences"
    (`[PAD]`, `##0`, ...): 129 instances of tokens in a prepare of two books, and tokens in
    a trained vocabulary, without a word."""
    from bertforge.pipelines.read.input_files import iter_texts

    google = tmp_path / "vocab.txt"
    google.write_text(google_style_vocab())
    ours = tmp_path / "ours.txt"  # bertforge vocab's layout, CRLF as a Windows editor saves it
    ours.write_bytes("\r\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "##0", "the",
                                  *(f"w{i}" for i in range(40))]).encode())
    for path in (google, ours):
        (reject,) = _read(path)
        assert (reject.reason, reject.source) == ("vocabulary_file", str(path))
        assert "not corpus" in reject.detail
    # Text is read: a word list (no special tokens), and a file that mentions [CLS] in prose.
    words = tmp_path / "words.txt"
    words.write_text("\n".join(f"word{i}" for i in range(100)) + "\n")
    assert _reasons(_read(words)) == [] and len(_read(words)) == 1
    prose = tmp_path / "prose.txt"
    prose.write_text("[PAD]\n[UNK]\n[CLS]\n" + "A sentence of several words.\n" * 30)
    assert _reasons(_read(prose)) == []
    skipped = Counter()
    assert list(iter_texts([str(google), str(prose)], skipped=skipped))  # the vocab trainer's
    assert skipped == {"vocabulary_file": 1}
