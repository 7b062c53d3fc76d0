"""Corpus readers: one small function per input format, all yielding `RawDocument`s or `Reject`s.

Readers take an open binary stream, so the same code serves the Beam job (which opens files
through Beam's `FileSystems`: local, gs://, s3://, with .gz/.bz2 decompressed by extension) and
the vocabulary trainer (plain `open`). Adding a format is a new reader function plus one entry in
`READERS`.

Formats so far:
- JSON Lines (`.jsonl`, `.json`): one object per line with a `text` field and an optional
  `doc_id`; the text is split into sentences later.
- Google's plain text (any other extension): one sentence per line, a blank line between
  documents, as `create_pretraining_data.py` reads it.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, NamedTuple

COMPRESSION_SUFFIXES = (".gz", ".bz2")


class RawDocument(NamedTuple):
    doc_id: str
    source: str  # "path:line" of the record, for logs and rejects
    text: str | None = None  # free text, to be split into sentences
    sentences: tuple[str, ...] | None = None  # already one sentence per entry


class Reject(NamedTuple):
    reason: str  # e.g. invalid_json, empty_document, too_few_sentences, duplicate_document
    source: str
    doc_id: str = ""
    detail: str = ""

    def to_json(self) -> str:
        return json.dumps(self._asdict(), ensure_ascii=False, sort_keys=True)


Reader = Callable[[str, str, Iterable[bytes]], Iterator["RawDocument | Reject"]]


def read_jsonl(
    path: str, doc_id_prefix: str, lines: Iterable[bytes]
) -> Iterator[RawDocument | Reject]:
    """One document per non-blank line; doc_id from the record or `<prefix>:<record index>`."""
    record_index = 0
    for line_number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        source = f"{path}:{line_number}"
        default_id = f"{doc_id_prefix}:{record_index}"
        record_index += 1
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            yield Reject("invalid_json", source, default_id, str(error)[:200])
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            yield Reject("missing_text", source, default_id, "no string 'text' field")
            continue
        doc_id = str(record["doc_id"]) if record.get("doc_id") not in (None, "") else default_id
        if not record["text"].strip():
            yield Reject("empty_document", source, doc_id)
            continue
        yield RawDocument(doc_id, source, text=record["text"])


def read_sentence_per_line(
    path: str, doc_id_prefix: str, lines: Iterable[bytes]
) -> Iterator[RawDocument | Reject]:
    """Google's format: one sentence per line, documents separated by blank lines."""
    doc_index = 0
    sentences: list[str] = []
    start_line = 1
    for line_number, raw in enumerate(lines, start=1):
        line = raw.decode("utf-8", errors="replace").strip()
        if line:
            if not sentences:
                start_line = line_number
            sentences.append(line)
            continue
        if sentences:
            yield RawDocument(
                f"{doc_id_prefix}:{doc_index}", f"{path}:{start_line}", sentences=tuple(sentences)
            )
            doc_index += 1
            sentences = []
    if sentences:
        yield RawDocument(
            f"{doc_id_prefix}:{doc_index}", f"{path}:{start_line}", sentences=tuple(sentences)
        )


READERS: dict[str, Reader] = {".jsonl": read_jsonl, ".json": read_jsonl}
DEFAULT_READER: Reader = read_sentence_per_line


def format_extension(path: str) -> str:
    """The extension that names the format, past any compression suffix: a.jsonl.gz -> .jsonl."""
    name = os.path.basename(path).lower()
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return os.path.splitext(name)[1]


def reader_for(path: str) -> Reader:
    return READERS.get(format_extension(path), DEFAULT_READER)


def read_documents(
    path: str, doc_id_prefix: str, stream: BinaryIO
) -> Iterator[RawDocument | Reject]:
    """Documents and rejects of one already-opened (and decompressed) file."""
    yield from reader_for(path)(path, doc_id_prefix, iter_lines(stream))


def iter_lines(stream: BinaryIO) -> Iterator[bytes]:
    """Lines by `readline`: Beam's compressed-file streams are not iterable."""
    while line := stream.readline():
        yield line


def doc_id_prefixes(paths: list[str]) -> dict[str, str]:
    """The doc_id prefix of each input file: its base name, or its path when base names collide.

    Two files named `part-0.jsonl` in different directories must not give the same doc_ids.
    """
    names = [os.path.basename(p) for p in paths]
    return {p: (n if names.count(n) == 1 else p) for p, n in zip(paths, names, strict=True)}


def open_local(path: str) -> BinaryIO:
    """Open a local file, decompressing .gz and .bz2 by extension."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def iter_texts(paths: list[str]) -> Iterator[str]:
    """Stream the texts of local corpus files (a text per record or per sentence line).

    Used to train a vocabulary without ever holding the corpus in memory.
    """
    for path, prefix in doc_id_prefixes(paths).items():
        with open_local(path) as stream:
            for item in read_documents(path, prefix, stream):
                if isinstance(item, Reject):
                    continue
                if item.text is not None:
                    yield item.text
                else:
                    yield from item.sentences or ()
