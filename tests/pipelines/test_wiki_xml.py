"""MediaWiki dump reading: schema versions, article filtering, recovery, multistream ranges."""

from __future__ import annotations

import bz2
import io
import re

import pytest

from bertforge.pipelines.read import wiki_xml
from bertforge.pipelines.read.input_files import open_local, read_file
from bertforge.pipelines.read.records import RawDocument, Reject

from .conftest import shared_data_file

# (file, articles = ns 0 and not a redirect, per SOURCES.md)
DUMPS = [
    ("enwiki-wikibrain-en_test.xml.bz2", 33),  # schema 0.8, 44 pages, 11 redirects
    ("enwiki-pages-articles-sample.xml.bz2", 2),  # 0.9, 3 pages, 1 redirect
    ("enwiki-table-markup.xml.bz2", 5),  # 0.10, no <siteinfo>
    ("enwiki-20250201-tiny_dump.xml.bz2", 6),  # 0.11, no <siteinfo>, 64 redirects
]

PAGE = (
    "<page><title>{title}</title><ns>{ns}</ns><id>{id}</id>{redirect}<revision><id>1</id>"
    '<text xml:space="preserve">{text}</text></revision></page>\n'
)


def _page(page_id: int, text: str, ns: int = 0, redirect: bool = False) -> str:
    return PAGE.format(
        title=f"T{page_id}",
        ns=ns,
        id=page_id,
        redirect='<redirect title="X"/>' if redirect else "",
        text=text,
    )


def _read(data: bytes, name: str = "dump.xml"):
    return list(wiki_xml.read_wiki_xml(name, "w", io.BytesIO(data)))


@pytest.mark.parametrize(("name", "num_articles"), DUMPS)
def test_every_schema_version_yields_its_articles(name, num_articles):
    path = str(shared_data_file(name))
    items = list(read_file(path, "w", "wiki", open_local))
    assert [i for i in items if isinstance(i, Reject)] == []
    docs = [i for i in items if isinstance(i, RawDocument)]
    assert len(docs) == num_articles
    assert all(re.fullmatch(r"w:\d+", d.doc_id) for d in docs)
    assert len({d.doc_id for d in docs}) == num_articles


def test_namespaces_redirects_and_empty_pages():
    xml = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n'
        + _page(1, "An article. It has text.")
        + _page(2, "Talk page. Not an article.", ns=1)
        + _page(3, "#REDIRECT [[X]]", redirect=True)
        + _page(4, "{{only a template}}")
        + "</mediawiki>\n"
    )
    items = _read(xml.encode())
    assert [(type(i).__name__, i.doc_id) for i in items] == [
        ("RawDocument", "w:1"),
        ("Reject", "w:4"),
    ]
    assert items[1].reason == "empty_page"


def test_malformed_pages_and_garbage_are_counted_and_skipped():
    xml = (
        "<mediawiki>\n"
        + _page(1, "First. Good.")
        + "<page><title>Cut</title><ns>0</ns><id>2</id><revision><text>half a pa\n"  # cut
        + _page(3, "Third. Good.")
        + "\x00garbage between pages\n"
        + "<page><title>Bad</title><ns>0</ns><id>4</id><unclosed></page>\n"
        + _page(5, "Fifth. Good.")
        + "</mediawiki>\n"
    )
    items = _read(xml.encode())
    assert [d.doc_id for d in items if isinstance(d, RawDocument)] == ["w:1", "w:3", "w:5"]
    assert [r.reason for r in items if isinstance(r, Reject)] == ["malformed_xml"] * 3


def test_a_byte_order_mark_before_the_dump_is_no_garbage():
    """Saved by an editor that writes one: the frame, not a malformed page."""
    xml = ('<?xml version="1.0"?>\n<mediawiki>\n' + _page(1, "First. Good.")
           + _page(2, "Second. Good.") + "</mediawiki>\n")
    items = _read(b"\xef\xbb\xbf" + xml.encode())
    assert [(type(i).__name__, i.doc_id) for i in items] == [
        ("RawDocument", "w:1"), ("RawDocument", "w:2")]


def test_a_page_split_across_reads_is_whole(monkeypatch):
    monkeypatch.setattr(wiki_xml, "READ_BYTES", 7)  # every tag straddles a read boundary
    xml = "<mediawiki>" + "".join(_page(i, f"Page {i}. Text &amp; more.") for i in range(5))
    docs = _read((xml + "</mediawiki>").encode())
    assert [d.text for d in docs] == [f"Page {i}. Text & more." for i in range(5)]


def _multistream(pages: list[str], pages_per_stream: int) -> tuple[bytes, bytes]:
    """A -multistream.xml.bz2 and its index, as Wikimedia builds them (header stream first)."""
    streams = [bz2.compress(b"<mediawiki>\n  <siteinfo><sitename>W</sitename></siteinfo>\n")]
    index = []
    offset = len(streams[0])
    for start in range(0, len(pages), pages_per_stream):
        group = pages[start : start + pages_per_stream]
        for page in group:
            page_id = re.search(r"<id>(\d+)</id>", page).group(1)
            index.append(f"{offset}:{page_id}:T{page_id}\n")
        streams.append(bz2.compress("".join(group).encode()))
        offset += len(streams[-1])
    streams.append(bz2.compress(b"</mediawiki>\n"))
    return b"".join(streams), bz2.compress("".join(index).encode())


def test_multistream_dump_reads_whole_and_by_index_ranges(tmp_path):
    pages = [_page(i, f"Article {i} first. Article {i} second.") for i in range(1, 41)]
    data, index = _multistream(pages, pages_per_stream=3)
    path = tmp_path / "wiki-multistream.xml.bz2"
    path.write_bytes(data)
    (tmp_path / "wiki-multistream-index.txt.bz2").write_bytes(index)
    assert wiki_xml.multistream_index_path(str(path)) == str(
        tmp_path / "wiki-multistream-index.txt.bz2"
    )
    whole = list(read_file(str(path), "w", "wiki", open_local))
    assert len(whole) == 40 and all(isinstance(d, RawDocument) for d in whole)
    offsets = wiki_xml.stream_offsets(iter(bz2.decompress(index).splitlines(keepends=True)))
    ranges = wiki_xml.plan_ranges(offsets, len(data), range_bytes=200)
    assert len(ranges) > 3
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    by_range = [
        d for r in ranges for d in read_file(str(path), "w", "wiki", open_local, byte_range=r)
    ]
    assert by_range == whole
