"""A file's format from its prefix, its name, else its content: Wikimedia's split and multistream
part names, files without an extension, `.txt` files that are XML; names the content contradicts
are refused (`format_mismatch`), never read as the wrong thing."""

from __future__ import annotations

import bz2
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.prepare import run
from bertforge.pipelines.read import inputs_transform, wiki_xml
from bertforge.pipelines.read.input_files import detect_format, iter_texts, open_local, read_file
from bertforge.pipelines.read.readers import choose_format, name_format, sniff_format
from bertforge.pipelines.read.records import RawDocument

from .conftest import SHARED_DATA, prepare_config
from .test_wiki_xml import _multistream, _page

SPLIT = "enwiki-20241101-pages-articles1.xml-p1p41242.bz2"
PART = "enwiki-20241101-pages-articles-multistream1.xml-p1p41242.bz2"
PART_INDEX = "enwiki-20241101-pages-articles-multistream-index1.txt-p1p41242.bz2"
XML_HEAD = b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11">\n'


def test_names_that_say_and_names_that_do_not():
    assert name_format(SPLIT) == "wiki" and name_format(PART) == "wiki"
    assert name_format("dump.xml.bz2") == "wiki" and name_format("a.JSONL.gz") == "jsonl"
    for silent in ("enwiki-latest-pages-articles", "corpus.txt", "corpus.txt.bz2", "x.xml-old"):
        assert name_format(silent) is None, silent


def test_a_format_prefix_heading_a_comma_separated_list_is_the_whole_lists(tmp_path):
    """`--input books:a.txt,b.txt` read a.txt as a book and b.txt as one sentence a line."""
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text("One sentence.\n")
    a, b, c = (str(tmp_path / name) for name in ("a.txt", "b.txt", "c.txt"))
    patterns = inputs_transform.input_patterns([f"books:{a},{b}", f"{c},books:{a}"])
    assert patterns == (f"books:{a}", f"books:{b}", c, f"books:{a}")
    assert inputs_transform.match_inputs(patterns[:2]) == [(a, "books"), (b, "books")]
    assert inputs_transform.input_patterns([f"{a}, wiki:{b} ,{c}"]) == (a, f"wiki:{b}", c)


def test_a_file_whose_name_holds_a_comma_or_glob_characters_is_that_file(tmp_path):
    """`part,1.jsonl` was split into `part` and `1.jsonl`, and `data[1].jsonl` globbed for
    `data1.jsonl`: both 'matched no file'."""
    for name in ("part,1.jsonl", "data[1].jsonl"):
        (tmp_path / name).write_text('{"text": "One. Two."}\n')
        path = str(tmp_path / name)
        patterns = inputs_transform.input_patterns([f"jsonl:{path}"])
        assert patterns == (f"jsonl:{path}",)
        assert inputs_transform.match_inputs(patterns) == [(path, "jsonl")]


def test_sniffing_the_first_bytes():
    assert sniff_format(b'<?xml version="1.0"?>\n' + XML_HEAD) == "wiki"
    assert sniff_format(b"\xef\xbb\xbf  " + XML_HEAD) == "wiki"
    assert sniff_format(b"  <page>\n    <title>A</title>") == "wiki"  # a multistream range
    assert sniff_format(b'{"text": "One. Two."}\n{"text": "x"}\n') == "jsonl"
    assert sniff_format(b'{"text": "' + b"a" * 9000) == "jsonl"  # a line longer than the head
    assert sniff_format(b"PAR1\x15\x04") == "parquet"
    for text in (b"One sentence.\nAnother.\n", b"{not json}\nx\n", b"[1, 2]\n", b"<p>html</p>"):
        assert sniff_format(text) is None, text


def test_a_name_the_content_contradicts_is_a_mismatch():
    assert choose_format("a.jsonl", None, XML_HEAD).mismatch.startswith("named jsonl (.jsonl)")
    assert "wiki:a.jsonl" in choose_format("a.jsonl", None, XML_HEAD).mismatch
    assert choose_format("d.xml", None, b'{"text": "x"}\n').mismatch
    # invalid_json later
    assert choose_format("a.jsonl", None, b"plain\n") == ("jsonl", "name", "", "")
    assert choose_format("a.jsonl", "wiki", b'{"text": "x"}\n') == ("wiki", "prefix", "", "")
    assert choose_format("notes", None, b"plain\n") == ("sentences", "content", "", "")


def test_multistream_part_names_find_their_index():
    assert wiki_xml.multistream_index_path(f"/d/{PART}") == f"/d/{PART_INDEX}"
    assert wiki_xml.multistream_index_path("/d/x-multistream.xml.bz2") == (
        "/d/x-multistream-index.txt.bz2"
    )
    assert wiki_xml.multistream_index_path(f"/d/{SPLIT}") is None  # not a multistream dump
    assert wiki_xml.is_multistream_index(PART_INDEX)
    assert wiki_xml.is_multistream_index("x-multistream-index.txt.bz2")
    assert not wiki_xml.is_multistream_index(PART)


def _wiki_pages(num_pages: int, first: int = 1) -> list[str]:
    return [
        _page(i, f"Article {i} first. Article {i} second.") for i in range(first, first + num_pages)
    ]


@pytest.fixture
def disguised(tmp_path):
    """Self-made files whose names do not say (or lie about) their format."""
    xml = "<mediawiki>\n" + "".join(_wiki_pages(5)) + "</mediawiki>\n"
    records = "".join(json.dumps({"text": f"Doc {i}. Second {i}."}) + "\n" for i in range(4))
    (tmp_path / "dump.txt").write_text(xml)  # .txt that is really XML
    (tmp_path / "dump-no-extension").write_bytes(bz2.compress(xml.encode()))
    (tmp_path / "records").write_text(records)
    pq.write_table(pa.table({"text": ["A b. C d."] * 3}), tmp_path / "table")
    (tmp_path / "xml.jsonl").write_text(xml)  # the name lies
    (tmp_path / "plain").write_text("One sentence.\nTwo.\n")
    return tmp_path


def test_detect_format_reads_disguised_files_right(disguised):
    expected = {
        "dump.txt": ("wiki", "content", "", ""),
        "dump-no-extension": ("wiki", "content", "", ""),
        "records": ("jsonl", "content", "", ""),
        "table": ("parquet", "content", "", ""),
        "plain": ("sentences", "content", "", ""),
    }
    for name, choice in expected.items():
        assert detect_format(str(disguised / name), None, open_local) == choice, name
    assert detect_format(str(disguised / "xml.jsonl"), None, open_local).mismatch
    docs = [d for d in read_file(str(disguised / "dump.txt"), "d", "wiki", open_local)]
    assert [d.text for d in docs][:1] == ["Article 1 first. Article 1 second."]
    texts = list(iter_texts([str(disguised / n) for n in ("dump-no-extension", "xml.jsonl")]))
    assert len(texts) == 5 and not any("<" in t for t in texts)  # the liar is skipped


def test_multistream_part_is_still_read_in_byte_ranges(tmp_path, monkeypatch):
    data, index = _multistream(_wiki_pages(40), pages_per_stream=3)
    (tmp_path / PART).write_bytes(data)
    (tmp_path / PART_INDEX).write_bytes(index)
    monkeypatch.setattr(wiki_xml, "RANGE_BYTES", 200)
    (files,) = [inputs_transform.input_files(inputs_transform.match_inputs((str(tmp_path),)))]
    assert [f.path for f in files] == [str(tmp_path / PART)]  # the index is not corpus
    ranges = list(inputs_transform.split_multistream(tuple(files[0])))
    assert len(ranges) > 3 and all(r.byte_range for r in ranges)
    by_range = [d for r in ranges for d in read_file(r.path, "w", "wiki", open_local, r.byte_range)]
    assert len(by_range) == 40 and all(isinstance(d, RawDocument) for d in by_range)


def test_prepare_records_every_format_and_counts_the_mismatch(disguised, small_vocab, tmp_path):
    """The job end to end: formats chosen per file, logged in the manifest, the liar rejected."""
    data, index = _multistream(_wiki_pages(40, first=100), pages_per_stream=3)
    (disguised / PART).write_bytes(data)
    (disguised / PART_INDEX).write_bytes(index)
    inputs = [str(disguised / n) for n in ("dump.txt", "records", "xml.jsonl", PART)]
    output = tmp_path / "out"
    config = prepare_config(inputs, str(output), small_vocab, validation_fraction=0.0,
                            num_validation_shards=0)
    summary = run(config)
    result = manifest.read_manifest(str(output))
    def entry(name, fmt, chosen_by):
        return {"format": fmt, "chosen_by": chosen_by,
                "bytes": (disguised / name).stat().st_size}

    # The liar is listed too, not read: the manifest names every input, and the same job
    # again (its identity: these files) was refused as "new: xml.jsonl" without it.
    assert result.input_files == {
        str(disguised / "dump.txt"): entry("dump.txt", "wiki", "content"),
        str(disguised / "records"): entry("records", "jsonl", "content"),
        str(disguised / "xml.jsonl"): entry("xml.jsonl", "not read", "format_mismatch"),
        str(disguised / PART): entry(PART, "wiki", "name"),
    }
    assert summary["input_formats"] == {"jsonl": 1, "not read": 1, "wiki": 2}
    from bertforge.cluster.safety.dataset_guard import differences_from_dataset

    assert differences_from_dataset(str(output), config) == []  # the same job again
    # A file read as another format makes other documents from the same bytes: not the same
    # job (it was: a `books:` prefix added after prepare's warning found "nothing to do").
    as_sentences = prepare_config([f"sentences:{disguised / 'dump.txt'}", *inputs[1:]],
                                  str(output), small_vocab, validation_fraction=0.0,
                                  num_validation_shards=0)
    assert differences_from_dataset(str(output), as_sentences) == [
        f"how the input files are read ({disguised / 'dump.txt'} as wiki -> sentences)"]
    assert summary["rejected"]["format_mismatch"] == 1
    assert summary["documents"] == 5 + 4 + 40
    rejects = (output / manifest.REJECTS_NAME).read_text()
    assert "xml.jsonl" in rejects and "format_mismatch" in rejects


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"{SHARED_DATA} not found: shared data absent")
def test_real_dumps_under_wikimedia_names(tmp_path, small_vocab):
    """The shared dumps copied to Wikimedia's split and multistream part names (no index beside
    the part: read whole) are read as wiki, exactly as with the `wiki:` prefix."""
    names = {
        "enwiki-wikibrain-en_test.xml.bz2": SPLIT,
        "enwiki-20250201-tiny_dump.xml.bz2": PART,
        "enwiki-table-markup.xml.bz2": "enwiki-latest-pages-articles",  # no extension
    }
    renamed, forced = tmp_path / "renamed", tmp_path / "forced"
    renamed.mkdir()
    forced.mkdir()
    for source, name in names.items():
        shutil.copy(SHARED_DATA / source, renamed / name)
        shutil.copy(SHARED_DATA / source, forced / source)
    by_name = run(prepare_config([str(renamed)], str(tmp_path / "a"), small_vocab))
    by_prefix = run(prepare_config([f"wiki:{forced}/*"], str(tmp_path / "b"), small_vocab))
    assert by_name["input_formats"] == {"wiki": 3}
    # Instances differ: doc_ids (hence every draw) come from the file names.
    for key in ("input_records", "documents", "sentences", "rejected"):
        assert by_name[key] == by_prefix[key], key
    chosen = manifest.read_manifest(str(tmp_path / "a")).input_files
    assert chosen[str(renamed / SPLIT)]["chosen_by"] == "name"
    assert chosen[str(renamed / "enwiki-latest-pages-articles")]["chosen_by"] == "content"


def test_a_prefix_dropped_since_is_a_difference_where_the_file_now_reads_otherwise(tmp_path):
    """A book prepared with `books:` and named without it since is read a sentence a line:
    another dataset. A prefix that chose what the name chooses anyway (`wiki:a.xml`) is none."""
    from bertforge.pipelines.dataset_identity import dataset_differences

    book, dump = tmp_path / "book.txt", tmp_path / "dump.xml"
    book.write_text("It was a dark and stormy\nnight. The rain fell.\n")
    dump.write_text("<mediawiki>\n" + "".join(_wiki_pages(2)) + "</mediawiki>\n")
    config = prepare_config([str(book), str(dump)], str(tmp_path / "out"), "vocab.txt")
    made = manifest.Manifest(
        manifest.TokenizerEntry("v", 320, True), config.instance_params(), {}, {},
        input_files={str(book): {"format": "books", "chosen_by": "prefix",
                                 "bytes": book.stat().st_size},
                     str(dump): {"format": "wiki", "chosen_by": "prefix",
                                 "bytes": dump.stat().st_size}})
    paths = [str(book), str(dump)]
    sizes = {path: (tmp_path / path).stat().st_size for path in paths}

    def differences(forced):
        return dataset_differences(made, config, paths, "v", sizes, forced_formats=forced)

    assert differences({str(book): None, str(dump): None}) == [
        f"how the input files are read ({book} as books -> sentences)"]
    assert differences({str(book): "books", str(dump): "wiki"}) == []
    assert differences({str(book): "books", str(dump): None}) == []
