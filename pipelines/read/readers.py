"""Corpus readers: one small function per input format, each yielding `RawDocument`s or `Reject`s.

A reader takes (path, doc_id prefix, decompressed binary stream), so the same code serves the Beam
job (files opened through Beam's `FileSystems`: local, gs://, s3://) and the vocabulary trainer
(plain `open`). Opening, decompression, and the checks every file gets (empty, binary, truncated)
live in `input_files`. Adding a format is a function plus one entry in `FORMATS`.

| format | named by | or by content | one document is |
|---|---|---|---|
| `jsonl` | `.jsonl`, `.json` | a JSON object on line 1 | a line's object: `text`, `doc_id`/`id` |
| `parquet` | `.parquet` | `PAR1` magic | a row: `text` column, `doc_id`/`id`; batch by batch |
| `wiki` | `.xml`, `.xml-p1p41242` (a part) | `<mediawiki`, `<page>` | an article (`wiki_xml`) |
| `wikiextractor` | - | `<doc id=` on line 1 | a `<doc>` block of WikiExtractor's default output |
| `books` | `books:` prefix only | - | a whole file; paragraphs on blank lines |
| `sentences` | - | anything else | Google's: a sentence a line, blank lines between documents |

A name that does not say (`.txt`, no extension, anything else) is sniffed: the first decompressed
bytes choose the format (`sniff_format`), plain text by default. A name whose format the content
contradicts (a `.jsonl` holding XML) is refused as `format_mismatch`, never read as the wrong
thing. `.txt` is ambiguous between a book and Google's format, so books are named explicitly:
`--input books:DIR/*.txt`. Any format can be forced the same way (`wiki:dump.bz2`); a forced
format is taken as given.

Invalid UTF-8 is replaced (U+FFFD), not rejected: one bad byte must not cost a whole book. Each
such record is listed as `invalid_utf8` among the *repaired* records (`records.REPAIRED_REASONS`).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, NamedTuple

from bertforge.pipelines.read.records import RawDocument, Reject
from bertforge.pipelines.read.wiki_xml import read_wiki_xml

COMPRESSION_SUFFIXES = (".gz", ".bz2")
BOM = "\ufeff"
PARQUET_BATCH_ROWS = 1024  # rows per record batch: bounds memory, whatever the file's size

Reader = Callable[[str, str, BinaryIO], Iterator["RawDocument | Reject"]]

__all__ = [
    "RawDocument", "Reject", "FORMATS", "format_of", "choose_format", "sniff_format",
    "read_documents", "doc_id_prefixes",
]  # fmt: skip


def iter_lines(stream: BinaryIO) -> Iterator[bytes]:
    """Lines by `readline`: Beam's file streams are not always iterable."""
    while line := stream.readline():
        yield line


def decode(raw: bytes, source: str, doc_id: str = "") -> tuple[str, Reject | None]:
    """UTF-8 text (a leading BOM dropped) and, for invalid bytes, the `invalid_utf8` repair."""
    try:
        text, repair = raw.decode("utf-8"), None
    except UnicodeDecodeError as error:
        text = raw.decode("utf-8", errors="replace")
        repair = Reject("invalid_utf8", source, doc_id, str(error)[:200])
    return text.lstrip(BOM), repair


def _record_id(record: dict[str, Any], doc_id_prefix: str, default: str) -> str:
    """The record's own `doc_id` or `id` within its file, else `default` (its index there).

    Scoped by the file's prefix: two files that each number their records from 0 (or two
    dumps' page ids) gave one doc_id to different texts, and all but one of each were
    rejected as `duplicate_doc_id`, half a corpus without a word. The same text in two files
    is still one document (`keep_first_copy` compares texts)."""
    for key in ("doc_id", "id"):
        if record.get(key) not in (None, ""):
            return f"{doc_id_prefix}:{record[key]}"
    return default


def read_jsonl(path: str, doc_id_prefix: str, stream: BinaryIO) -> Iterator[RawDocument | Reject]:
    """One document per non-blank line; doc_id `<prefix>:<the record's id>`, or
    `<prefix>:<record index>` for a record without one."""
    record_index = 0
    for line_number, raw in enumerate(iter_lines(stream), start=1):
        if not raw.strip():
            continue
        source = f"{path}:{line_number}"
        default_id = f"{doc_id_prefix}:{record_index}"
        record_index += 1
        line, repair = decode(raw, source, default_id)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            yield Reject("invalid_json", source, default_id, str(error)[:200])
            continue
        yield from _text_record(record, source, doc_id_prefix, default_id, repair)


def _text_record(
    record: Any, source: str, doc_id_prefix: str, default_id: str, repair: Reject | None
) -> Iterator[RawDocument | Reject]:
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        yield Reject("missing_text", source, default_id, "no string 'text' field")
        return
    doc_id = _record_id(record, doc_id_prefix, default_id)
    if not record["text"].strip():
        yield Reject("empty_document", source, doc_id)
        return
    if repair is not None:
        yield repair._replace(doc_id=doc_id)
    yield RawDocument(doc_id, source, text=record["text"])


def read_sentence_per_line(
    path: str, doc_id_prefix: str, stream: BinaryIO
) -> Iterator[RawDocument | Reject]:
    """Google's format: one sentence per line, documents separated by blank lines."""
    doc_index = 0
    sentences: list[str] = []
    start_line = 1
    repair: Reject | None = None

    def document() -> Iterator[RawDocument | Reject]:
        doc_id, source = f"{doc_id_prefix}:{doc_index}", f"{path}:{start_line}"
        if repair is not None:
            yield repair._replace(source=source, doc_id=doc_id)
        yield RawDocument(doc_id, source, sentences=tuple(sentences))

    for line_number, raw in enumerate(iter_lines(stream), start=1):
        line, bad = decode(raw, f"{path}:{line_number}")
        line = line.strip()
        if line:
            if not sentences:
                start_line, repair = line_number, None
            repair = repair or bad
            sentences.append(line)
            continue
        if sentences:
            yield from document()
            doc_index += 1
            sentences = []
    if sentences:
        yield from document()


_DOC_START = re.compile(r'^<doc\b[^>]*?\bid="([^"]*)"[^>]*>\s*$')
_DOC_TITLE = re.compile(r'\btitle="([^"]*)"')
_DOC_END = "</doc>"


def read_wikiextractor(
    path: str, doc_id_prefix: str, stream: BinaryIO
) -> Iterator[RawDocument | Reject]:
    """WikiExtractor's default output (`AA/wiki_00`): `<doc id=".." url=".." title="..">`, the
    title on the next line, then a paragraph a line, then `</doc>`. Each block is a document
    (doc_id: its `id`, as a JSON record's); its title line is left out, as NVIDIA's BERT
    scripts do, and each line is a paragraph of its own, so a section heading is never joined
    to the sentence after it. Read as plain text, the tags became training text."""
    lines: list[str] | None = None  # inside a block: its lines so far
    doc_id = title = ""
    start_line, repair = 0, None
    for line_number, raw in enumerate(iter_lines(stream), start=1):
        line, bad = decode(raw, f"{path}:{line_number}")
        line = line.strip()
        opened = _DOC_START.match(line)
        if opened and lines is None:
            lines, start_line, repair = [], line_number, None
            found_title = _DOC_TITLE.search(line)
            title = html.unescape(found_title.group(1)) if found_title else ""
            # Scoped by the file, as a JSON record's id (`_record_id`): two dumps' page ids
            # overlap.
            doc_id = f"{doc_id_prefix}:{opened.group(1) or line_number}"
        elif line == _DOC_END and lines is not None:
            yield from _wikiextractor_document(lines, title, doc_id, f"{path}:{start_line}",
                                               repair)
            lines = None
        elif lines is not None and line:
            repair = repair or bad
            lines.append(html.unescape(line))  # its default, --html-safe, escapes & < >
    if lines is not None:  # a file cut inside its last block: what it holds is still text
        yield from _wikiextractor_document(lines, title, doc_id, f"{path}:{start_line}", repair)


def _wikiextractor_document(lines: list[str], title: str, doc_id: str, source: str,
                            repair: Reject | None) -> Iterator[RawDocument | Reject]:
    if lines and lines[0] == title:
        lines = lines[1:]
    if not lines:
        yield Reject("empty_document", source, doc_id)
        return
    if repair is not None:
        yield repair._replace(source=source, doc_id=doc_id)
    yield RawDocument(doc_id, source, text="\n\n".join(lines))


def read_book(path: str, doc_id_prefix: str, stream: BinaryIO) -> Iterator[RawDocument | Reject]:
    """The whole file is one document (a book); CRLF and a BOM are fine.

    Paragraph and sentence boundaries are found later (`pipelines.instances.sentences`): blank
    lines end a paragraph, and hard-wrapped lines inside one are joined.
    """
    text, repair = decode(stream.read(), path, doc_id_prefix)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        yield Reject("empty_document", path, doc_id_prefix)
        return
    if repair is not None:
        yield repair
    yield RawDocument(doc_id_prefix, f"{path}:1", text=text)


def read_parquet(path: str, doc_id_prefix: str, stream: BinaryIO) -> Iterator[RawDocument | Reject]:
    """Rows of a `text` column (and `doc_id` or `id` when present), one record batch at a time.

    `stream` must be seekable (Parquet's footer is at the end): it is the raw file, never
    decompressed (Parquet compresses inside).
    """
    import pyarrow.parquet as pq  # only Parquet inputs pay for it

    try:
        parquet = pq.ParquetFile(stream)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError...: all mean "not Parquet"
        yield Reject("invalid_parquet", path, "", str(error)[:200])
        return
    names = parquet.schema_arrow.names
    if "text" not in names:
        yield Reject("missing_text", path, "", f"no 'text' column in {names[:20]}")
        return
    columns = ["text"] + [c for c in ("doc_id", "id") if c in names][:1]
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            yield from _text_record(record, f"{path}:{row}", doc_id_prefix,
                                    f"{doc_id_prefix}:{row}", None)
            row += 1


FORMATS: dict[str, Reader] = {
    "jsonl": read_jsonl,
    "parquet": read_parquet,
    "wiki": read_wiki_xml,
    "wikiextractor": read_wikiextractor,
    "books": read_book,
    "sentences": read_sentence_per_line,
}
EXTENSION_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".xml": "wiki"}
# Wikimedia's split dumps: enwiki-20241101-pages-articles1.xml-p1p41242.bz2 (and -multistream1).
WIKIMEDIA_PART = re.compile(r"\.xml-p\d+p\d+$")
DEFAULT_FORMAT = "sentences"
# Formats that read a raw seekable file rather than a decompressed, sniffed stream.
RAW_FORMATS = frozenset({"parquet"})
PARQUET_MAGIC = b"PAR1"
_XML_DECLARATION = re.compile(rb"^<\?xml[^>]*\?>\s*")


def format_extension(path: str) -> str:
    """The extension that names the format, past any compression suffix: a.jsonl.gz -> .jsonl."""
    name = os.path.basename(path).lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return os.path.splitext(name)[1]


def split_format(pattern: str) -> tuple[str | None, str]:
    """`books:DIR/*.txt` -> ("books", "DIR/*.txt"); patterns without a format prefix: (None, p).

    Only the names in FORMATS are prefixes, so `gs://...` and `s3://...` pass through.
    """
    name, colon, rest = pattern.partition(":")
    if colon and name in FORMATS:
        return name, rest
    return None, pattern


def name_format(path: str) -> str | None:
    """The format a file's name says, or None when it says none (`.txt`, no extension, ...)."""
    extension = format_extension(path)
    if WIKIMEDIA_PART.match(extension):
        return "wiki"
    return EXTENSION_FORMATS.get(extension)


def format_of(path: str, forced: str | None = None) -> str:
    """The format by prefix or name alone (content unseen): plain text when the name says none."""
    return forced or name_format(path) or DEFAULT_FORMAT


def sniff_format(head: bytes) -> str | None:
    """The format the first bytes of a file show (decompressed, but raw for Parquet), or None.

    `<mediawiki` (after an XML declaration) or `<page>` -> wiki; `<doc id="...` as the whole
    first line -> wikiextractor; a first line that is a JSON
    object -> jsonl (a line longer than `head` counts when it starts like one); `PAR1` -> parquet.
    Plain text shows nothing: the caller's default applies.
    """
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    start = _XML_DECLARATION.sub(b"", head.lstrip(BOM.encode() + b" \t\r\n"))
    if start.startswith((b"<mediawiki", b"<page>")):
        return "wiki"
    if _DOC_START.match(start.partition(b"\n")[0].decode("utf-8", "replace").strip()):
        return "wikiextractor"
    first_line, newline, _ = start.partition(b"\n")
    if first_line.startswith(b"{"):
        if not newline:
            return "jsonl"  # one line longer than the head: cannot be parsed here
        try:
            return "jsonl" if isinstance(json.loads(first_line), dict) else None
        except ValueError:
            return None
    return None


class FormatChoice(NamedTuple):
    fmt: str
    chosen_by: str  # "prefix", "name" or "content"
    mismatch: str = ""  # why the name and the content disagree ("": they agree)
    doubt: str = ""  # what makes the content's choice look wrong ("": nothing seen)


# A line that ends a sentence: its last word's stop, then closing quotes or brackets.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")


def hard_wrapped_doubt(head: bytes) -> str:
    """Why plain text read as a sentence a line looks like hard-wrapped prose, or "".

    Read as sentences, each wrapped line is a "sentence": pairs and NSP are cut at random
    places, and a paragraph of few lines is rejected as too short. Prose wrapped at ~70
    characters has most lines 50-80 long and most ending mid-sentence; on the shared data, in
    8 KB windows: three Gutenberg novels 62-94 % of lines in that band and 13-41 % ending a
    sentence, Wikipedia split a sentence a line (Google's format) 28 % at most in the band. (A
    play's verse lines are neither.) The head's last line may be cut: it is left out."""
    lines = [line.strip() for line in head.decode("utf-8", "replace").splitlines()[:-1]]
    lines = [line for line in lines if line]
    if len(lines) < 20:
        return ""
    ending = sum(bool(_SENTENCE_END.search(line)) for line in lines) / len(lines)
    wrapped = sum(50 <= len(line) <= 80 for line in lines) / len(lines)
    if ending >= 0.5 or wrapped < 0.5:
        return ""
    return (f"{100 - round(100 * ending)} % of its first {len(lines)} lines end mid-sentence: "
            "hard-wrapped prose, such as a book?")


def choose_format(path: str, forced: str | None, head: bytes) -> FormatChoice:
    """The format to read `path` as: the prefix, else the name, else the content (`head`).

    A name that the content contradicts (a `.jsonl` that is XML) gives a `mismatch` to refuse,
    never a silent reading as either format.
    """
    if forced:
        return FormatChoice(forced, "prefix")
    named, sniffed = name_format(path), sniff_format(head)
    if named is None:
        fmt = sniffed or DEFAULT_FORMAT
        doubt = hard_wrapped_doubt(head) if fmt == "sentences" else ""
        return FormatChoice(fmt, "content", doubt=doubt)
    if sniffed is not None and sniffed != named:
        return FormatChoice(
            named,
            "name",
            f"named {named} ({format_extension(path)}) but its content is {sniffed}: rename it, "
            f"or force a format with a prefix ({sniffed}:{path})",
        )
    return FormatChoice(named, "name")


def read_documents(
    path: str, doc_id_prefix: str, stream: BinaryIO, fmt: str | None = None
) -> Iterator[RawDocument | Reject]:
    """Documents and rejects of one opened (and, but for Parquet, decompressed) file."""
    yield from FORMATS[format_of(path, fmt)](path, doc_id_prefix, stream)


def doc_id_prefixes(paths: Iterable[str]) -> dict[str, str]:
    """The doc_id prefix of each input file: its base name, or, where base names collide, its
    path below the colliding files' common folder (WikiExtractor's `AA/wiki_00`, `AB/wiki_00`).

    Two files named `part-0.jsonl` in different directories must not give the same doc_ids;
    and how the paths were spelled (relative, absolute, from another working directory) must
    not change them, nor with them the dataset's bytes."""
    paths = list(paths)
    by_name: dict[str, list[str]] = {}
    for path in paths:
        by_name.setdefault(os.path.basename(path), []).append(path)
    prefixes = {}
    for name, group in by_name.items():
        if len(group) == 1:
            prefixes[group[0]] = name
            continue
        located = {path: input_location(path) for path in group}
        common = _common_folder(list(located.values()))
        for path, where in located.items():
            prefixes[path] = where[len(common):].lstrip("/")
    return {path: prefixes[path] for path in paths}


def input_location(path: str, working_directory: str | None = None) -> str:
    """Where an input path points, however it was spelled: a local one absolute and real (a
    relative one taken in `working_directory`, default this process's), a URL as it is."""
    if "://" in path:
        return path
    return os.path.realpath(os.path.join(working_directory or os.getcwd(), path))


def lies_within(path: str, folder: str) -> bool:
    """Whether the absolute `path` is `folder` or lies in it (by the names as given)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _common_folder(paths: list[str]) -> str:
    """The longest folder ("a/b/", ending in "/") that every path lies in."""
    folders = [path.rsplit("/", 1)[0] + "/" if "/" in path else "" for path in paths]
    common = os.path.commonprefix(folders)
    return common[: common.rfind("/") + 1]
