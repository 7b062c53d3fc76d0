"""Opening one input file (or a byte range of one): decompression, and the file-level rejects.

Every file goes through `read_file`, which a Beam DoFn and the vocabulary trainer both call:
- decompression by extension with Python's own `bz2`/`gzip` (both read concatenated streams, so
  `-multistream` dumps need nothing special); Beam's filesystem only supplies raw bytes;
- a truncated or corrupt compressed file keeps the records read before the damage and adds one
  `truncated_compressed_file` / `corrupt_compressed_file` reject;
- `empty_file` for zero bytes or no record at all, `binary_file` for content that is not text,
  `utf16_file` for UTF-16 text (UTF-8 is read), `vocabulary_file` for a WordPiece vocabulary
  (a `vocab.txt` kept beside the corpus: read, its tokens became a document of "sentences").

`detect_format` chooses a file's format before it is read: a format prefix, else its name, else
its first decompressed bytes (`readers.choose_format`).
"""

from __future__ import annotations

import bz2
import gzip
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import BinaryIO

from bertforge.pipelines.read import readers
from bertforge.pipelines.read.records import RawDocument, Reject

SNIFF_BYTES = 8192
# Text has no NUL and few control characters; 10 % of them (tabs/newlines excepted) means binary.
MAX_CONTROL_FRACTION = 0.1
_CONTROL = bytes(b for b in range(32) if b not in b"\t\n\r\f\v") + b"\x7f"

# The most a GuardedStream decompresses in one call: what a truncated file loses at its end.
GUARDED_READ_BYTES = 64 << 10

Opener = Callable[[str], BinaryIO]  # path -> raw binary stream (seekable for Parquet and ranges)


class GuardedStream:
    """A decompressing stream that turns a decompression error into end-of-file plus a note.

    Readers then finish with what they got; `error` says what happened for the rejects file.
    """

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self.error: Exception | None = None

    def _guard(self, call, *args) -> bytes:
        if self.error is not None:
            return b""
        try:
            return call(*args)
        except (EOFError, OSError, zlib.error) as error:
            self.error = error
            return b""

    def read(self, size: int = -1) -> bytes:
        # In pieces: what one call decompressed before the cut is lost with its error, and a
        # reader asking for a megabyte at a time kept none of a small file's whole articles.
        pieces, wanted = [], size if size >= 0 else float("inf")
        while wanted > 0:
            piece = self._guard(self._stream.read, int(min(wanted, GUARDED_READ_BYTES)))
            if not piece:
                break
            pieces.append(piece)
            wanted -= len(piece)
        return b"".join(pieces)

    def readline(self, size: int = -1) -> bytes:
        return self._guard(self._stream.readline, size)


class PrefixedStream:
    """`head` (already read to sniff the file) followed by the rest of `stream`."""

    def __init__(self, head: bytes, stream):
        self._head = head
        self._stream = stream

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if size < 0:
            data, self._head = self._head + self._stream.read(), b""
            return data
        data, self._head = self._head[:size], self._head[size:]
        if len(data) < size:  # the head ran out: the rest from the stream, as a file would
            data += self._stream.read(size - len(data))
        return data

    def readline(self, size: int = -1) -> bytes:
        if not self._head:
            return self._stream.readline(size)
        newline = self._head.find(b"\n")
        if newline >= 0:
            line, self._head = self._head[: newline + 1], self._head[newline + 1 :]
            return line
        line, self._head = self._head, b""
        return line + self._stream.readline()


class LimitedStream:
    """At most `limit` bytes of `stream` from its current position (a byte range of a file)."""

    def __init__(self, stream: BinaryIO, limit: int):
        self._stream = stream
        self._left = limit

    def read(self, size: int = -1) -> bytes:
        size = self._left if size < 0 else min(size, self._left)
        data = self._stream.read(size) if size > 0 else b""
        self._left -= len(data)
        return data

    def readable(self) -> bool:
        return True


BZ2_MAGIC, GZIP_MAGIC = b"BZh", b"\x1f\x8b"


def decompressing(path: str, raw) -> BinaryIO:
    """`raw` decompressed by its extension, or by its magic bytes when the name says none (a
    dump saved without its extension); a name that says neither compression keeps plain files
    plain."""
    if path.endswith(".bz2"):
        return bz2.BZ2File(raw, "rb")  # type: ignore[return-value]
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    magic = raw.read(len(BZ2_MAGIC))
    raw = PrefixedStream(magic, raw)
    if magic == BZ2_MAGIC:
        return bz2.BZ2File(raw, "rb")  # type: ignore[return-value]
    if magic.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw  # type: ignore[return-value]


def detect_format(path: str, forced: str | None, opener: Opener) -> readers.FormatChoice:
    """The format to read `path` as (prefix, else name, else content) and how it was chosen.

    Reads at most SNIFF_BYTES decompressed bytes (one bz2 block at most is decompressed); a
    prefix is taken as given without opening the file.
    """
    if forced:
        return readers.FormatChoice(forced, "prefix")
    with opener(path) as raw:
        magic = raw.read(len(readers.PARQUET_MAGIC))
        if magic == readers.PARQUET_MAGIC:  # Parquet compresses inside: its magic is raw
            head = magic
        else:
            stream = GuardedStream(decompressing(path, PrefixedStream(magic, raw)))
            head = stream.read(SNIFF_BYTES)
    return readers.choose_format(path, None, head)


def format_mismatch(path: str, choice: readers.FormatChoice) -> Reject:
    return Reject("format_mismatch", path, "", choice.mismatch)


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


# BERT's special tokens, each a line of every WordPiece vocab.txt (Google's within its first 104).
VOCAB_SPECIAL_LINES = frozenset({b"[PAD]", b"[UNK]", b"[CLS]", b"[SEP]", b"[MASK]"})
MIN_VOCAB_LINES = 20


def looks_like_vocabulary(head: bytes) -> bool:
    """A WordPiece vocabulary's first bytes: a token a line, no spaces inside one, and at least
    three of BERT's special tokens among them. Text, even a word list, has no `[CLS]` line."""
    lines = head.split(b"\n")[:-1] if len(head) == SNIFF_BYTES else head.split(b"\n")
    lines = [line.rstrip(b"\r") for line in lines]
    if len(lines) < MIN_VOCAB_LINES or any(not line.strip() or len(line.split()) != 1
                                           for line in lines if line):
        return False
    return len(VOCAB_SPECIAL_LINES.intersection(lines)) >= 3


def looks_binary(head: bytes) -> bool:
    if b"\x00" in head:
        return True
    num_control = sum(head.count(bytes([c])) for c in _CONTROL)
    return num_control > MAX_CONTROL_FRACTION * len(head)


def _compression_reject(path: str, error: Exception) -> Reject:
    reason = (
        "truncated_compressed_file" if isinstance(error, EOFError) else "corrupt_compressed_file"
    )
    return Reject(reason, path, "", f"{type(error).__name__}: {error}"[:200])


def read_file(
    path: str,
    doc_id_prefix: str,
    fmt: str,
    opener: Opener,
    byte_range: tuple[int, int] | None = None,
) -> Iterator[RawDocument | Reject]:
    """Documents and rejects of a file, or of the byte range [start, end) of a multistream dump."""
    with opener(path) as raw:
        if fmt in readers.RAW_FORMATS:
            yield from _read_raw_format(path, doc_id_prefix, fmt, raw)
            return
        if byte_range is not None:
            raw.seek(byte_range[0])
            raw = LimitedStream(raw, byte_range[1] - byte_range[0])
        stream = GuardedStream(decompressing(path, raw))
        head = stream.read(SNIFF_BYTES)
        if not head.strip():
            yield (
                _compression_reject(path, stream.error)
                if stream.error
                else Reject("empty_file", path, "", "no bytes" if not head else "whitespace only")
            )
            return
        if head.startswith(UTF16_BOMS):  # its zero bytes would call it binary
            yield Reject("utf16_file", path, "", "UTF-16 text (its byte-order mark): convert it "
                         "to UTF-8, e.g. `iconv -f UTF-16 -t UTF-8`")
            return
        if looks_binary(head):
            yield Reject("binary_file", path, "", f"first bytes {head[:24]!r}")
            return
        if looks_like_vocabulary(head):
            yield Reject("vocabulary_file", path, "", "a WordPiece vocabulary (a token a line: "
                         "[PAD], [UNK], [CLS], ...), not corpus: keep it apart from the corpus")
            return
        num_items = 0
        for item in readers.read_documents(path, doc_id_prefix, PrefixedStream(head, stream), fmt):
            num_items += 1
            yield item
        if stream.error is not None:
            yield _compression_reject(path, stream.error)
        elif num_items == 0:
            yield Reject("empty_file", path, "", f"no {fmt} record")


def _read_raw_format(
    path: str, doc_id_prefix: str, fmt: str, raw
) -> Iterator[RawDocument | Reject]:
    num_items = 0
    for item in readers.read_documents(path, doc_id_prefix, raw, fmt):
        num_items += 1
        yield item
    if num_items == 0:
        yield Reject("empty_file", path, "", f"no {fmt} record")


def open_local(path: str) -> BinaryIO:
    return open(path, "rb")


def iter_texts(paths: list[str], formats: dict[str, str] | None = None,
               skipped: Counter | None = None, read_from: set[str] | None = None
               ) -> Iterator[str]:
    """Stream the texts of local corpus files (a text per record or per sentence line).

    Used to train a vocabulary without ever holding the corpus in memory. What prepare would
    reject (a file whose name and content disagree, an empty or corrupt file, a bad record) is
    skipped, and counted by reason into `skipped` where given; repaired records are read. The
    files that gave any text are added to `read_from` where given.
    """
    formats = formats or {}
    for path, prefix in readers.doc_id_prefixes(paths).items():
        choice = detect_format(path, formats.get(path), open_local)
        if choice.mismatch:
            if skipped is not None:
                skipped["format_mismatch"] += 1
            continue
        for item in read_file(path, prefix, choice.fmt, open_local):
            if isinstance(item, Reject):
                if skipped is not None and not item.repaired:
                    skipped[item.reason] += 1
                continue
            if read_from is not None:
                read_from.add(path)
            if item.text is not None:
                yield item.text
            else:
                yield from item.sentences or ()
