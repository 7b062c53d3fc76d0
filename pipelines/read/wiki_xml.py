"""MediaWiki `pages-articles` XML dumps (export schemas 0.8-0.11) -> article documents, streamed.

The dump is scanned for `<page>...</page>` byte ranges and each page is parsed on its own with
ElementTree. Why not one `iterparse` over the file:
- recovery: expat stops at the first error, so one page cut mid-way would lose the rest of a
  20 GB dump; here the bad page is counted (`malformed_xml`) and the next `<page>` parses;
- namespace-agnostic for free: a page fragment carries no `xmlns`, so tags are bare names in
  every schema version;
- the same code reads a byte range of a `-multistream` dump (no `<mediawiki>` root around it).
Scanning for the literal `<page>` is exact: inside an element's text `<` is always escaped.

Memory is one page (capped at `MAX_PAGE_BYTES`) plus one read chunk, whatever the dump's size.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple

from bertforge.pipelines.read.records import RawDocument, Reject
from bertforge.pipelines.read.wikitext import wikitext_to_paragraphs

PAGE_OPEN = b"<page>"
PAGE_CLOSE = b"</page>"
READ_BYTES = 1 << 20
# The largest English article is ~1.3 MB of wikitext; a "page" past this is a broken file.
MAX_PAGE_BYTES = 64 << 20
MAX_OUTSIDE_BYTES = 1 << 20
# Text outside pages that is expected: the XML declaration, the root element and <siteinfo>.
# The dump's frame around its pages; a UTF-8 byte-order mark may open the file (as the
# format sniffer and the other readers allow).
_FRAME = re.compile(
    rb"\A\xef\xbb\xbf|<\?xml[^>]*\?>|<mediawiki\b[^>]*>|</mediawiki>|<siteinfo>.*?</siteinfo>",
    re.DOTALL,
)


class Page(NamedTuple):
    page_id: str
    title: str
    namespace: str
    redirect: bool
    wikitext: str


def iter_page_fragments(stream: BinaryIO) -> Iterator[tuple[int, bytes | None, bytes]]:
    """(offset, page bytes or None, bytes found between pages) in order.

    Offsets are in the decompressed stream, for the rejects file. A page that is not closed
    before the next `<page>` (or the end) comes back in the third slot, as unexpected bytes.
    Bytes between pages are gathered until the next page (the header with <siteinfo> is a few
    kB), or up to MAX_OUTSIDE_BYTES of garbage at a time.
    """
    buffer = bytearray()
    consumed = 0  # decompressed bytes before buffer[0]
    outside, outside_at = bytearray(), 0
    eof = False
    while not eof or buffer:
        if not eof and len(buffer) < 2 * READ_BYTES:
            chunk = stream.read(READ_BYTES)
            eof = not chunk
            buffer += chunk
            continue
        start = buffer.find(PAGE_OPEN)
        if start < 0:
            keep = 0 if eof else len(PAGE_OPEN) - 1  # a tag may straddle two reads
            cut = len(buffer) - keep
            outside_at = outside_at if outside else consumed
            outside += buffer[:cut]
            del buffer[:cut]
            consumed += cut
            if len(outside) > MAX_OUTSIDE_BYTES or eof:
                yield outside_at, None, bytes(outside)
                outside.clear()
            if eof:
                break
            continue
        end = _page_end(buffer, start)
        while end is None and not eof and len(buffer) - start <= MAX_PAGE_BYTES:
            chunk = stream.read(READ_BYTES)
            eof = not chunk
            buffer += chunk
            end = _page_end(buffer, start)
        if start or outside:
            outside_at = outside_at if outside else consumed
            yield outside_at, None, bytes(outside + buffer[:start])
            outside.clear()
        if end is None or end < 0:  # unclosed, oversized, or cut by the next page's opening
            stop = len(buffer) if end is None else -end
            if end is None and not eof:
                stop = start + MAX_PAGE_BYTES
            yield consumed + start, None, bytes(buffer[start:stop])
        else:
            stop = end
            yield consumed + start, bytes(buffer[start:stop]), b""
        del buffer[:stop]
        consumed += stop
    if outside:
        yield outside_at, None, bytes(outside)


def _page_end(buffer: bytearray, start: int) -> int | None:
    """End of the page opened at `start`; -(next page start) if another opens first; None."""
    close = buffer.find(PAGE_CLOSE, start + len(PAGE_OPEN))
    reopen = buffer.find(PAGE_OPEN, start + len(PAGE_OPEN))
    if reopen >= 0 and (close < 0 or reopen < close):
        return -reopen
    return close + len(PAGE_CLOSE) if close >= 0 else None


def parse_page(fragment: bytes) -> Page:
    """One `<page>` element -> Page; ET.ParseError for malformed XML."""
    page = ET.fromstring(fragment)
    revisions = page.findall("revision")
    # A full-history dump has many revisions; pages-articles has one. The last is the newest.
    text_element = revisions[-1].find("text") if revisions else None
    return Page(
        page_id=(page.findtext("id") or "").strip(),
        title=(page.findtext("title") or "").strip(),
        namespace=(page.findtext("ns") or "0").strip(),  # schemas before 0.6 had no <ns>
        redirect=page.find("redirect") is not None,
        wikitext=(text_element.text or "") if text_element is not None else "",
    )


def _unexpected(fragment: bytes) -> bytes:
    return _FRAME.sub(b"", fragment).strip()


def read_wiki_xml(
    path: str, doc_id_prefix: str, stream: BinaryIO
) -> Iterator[RawDocument | Reject]:
    """Articles (namespace 0, not redirects) as documents of clean paragraphs.

    Pages in other namespaces and redirects are skipped, not rejected: they are not articles,
    and a dump is mostly made of them (64 of the 70 pages of the 2025 excerpt are redirects).
    """
    for offset, fragment, unexpected in iter_page_fragments(stream):
        source = f"{path}@{offset}"
        if unexpected and (garbage := _unexpected(unexpected)):
            what = "unclosed page" if garbage.startswith(PAGE_OPEN) else "not a page"
            yield Reject("malformed_xml", source, "", f"{what}: {garbage[:120]!r}")
        if fragment is None:
            continue
        try:
            page = parse_page(fragment)
        except ET.ParseError as error:
            yield Reject("malformed_xml", source, "", str(error)[:200])
            continue
        if page.namespace != "0" or page.redirect:
            continue
        doc_id = f"{doc_id_prefix}:{page.page_id or page.title}"
        source = f"{path}:{page.page_id} {page.title}"
        paragraphs = wikitext_to_paragraphs(page.wikitext) if page.wikitext.strip() else []
        if not paragraphs:
            yield Reject("empty_page", source, doc_id, "no text" if not page.wikitext else "")
            continue
        yield RawDocument(doc_id, source, text="\n\n".join(paragraphs))


# ------------------------------------------------------------------ multistream dumps in parallel

# X-multistream.xml.bz2 and Wikimedia's parts, X-multistream1.xml-p1p41242.bz2; their indexes are
# X-multistream-index.txt.bz2 and X-multistream-index1.txt-p1p41242.bz2.
_MULTISTREAM = re.compile(r"^(?P<stem>.*-multistream)(?P<part>\d*)\.xml(?P<pages>-p\d+p\d+)?\.bz2$")
_MULTISTREAM_INDEX = re.compile(r"-multistream-index\d*\.txt(-p\d+p\d+)?\.bz2$")
# Compressed bytes per parallel read: ~30 s of work per range on one core.
RANGE_BYTES = 64 << 20


def multistream_index_path(path: str) -> str | None:
    """`X-multistream.xml.bz2` -> `X-multistream-index.txt.bz2`, and for a part,
    `X-multistream1.xml-p1p41242.bz2` -> `X-multistream-index1.txt-p1p41242.bz2` (Wikimedia's
    names); None for a file that is not named as a multistream dump."""
    match = _MULTISTREAM.match(path)
    if match is None:
        return None
    return f"{match['stem']}-index{match['part']}.txt{match['pages'] or ''}.bz2"


def is_multistream_index(path: str) -> bool:
    return _MULTISTREAM_INDEX.search(path) is not None


def stream_offsets(index_lines: Iterator[bytes]) -> list[int]:
    """Distinct stream start offsets of an index (`offset:page_id:title` per line), sorted."""
    offsets = set()
    for line in index_lines:
        head = line.split(b":", 1)[0]
        if head.strip().isdigit():
            offsets.add(int(head))
    return sorted(offsets)


def plan_ranges(
    offsets: list[int], file_size: int, range_bytes: int = RANGE_BYTES
) -> list[tuple[int, int]]:
    """[start, end) byte ranges that begin on stream boundaries, about `range_bytes` each.

    The first range starts at 0 (the header stream with <siteinfo>); the last ends at the file's
    end (the footer stream with </mediawiki>). Every byte is in exactly one range.
    """
    starts = [0] + [o for o in offsets if 0 < o < file_size]
    ranges, begin = [], 0
    for start in starts[1:]:
        if start - begin >= range_bytes:
            ranges.append((begin, start))
            begin = start
    ranges.append((begin, file_size))
    return ranges
