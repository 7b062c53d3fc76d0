"""PCollections on disk: what Beam's FnApiRunner keeps in memory between stages, written to files.

Beam's local runner holds every PCollection between two stages in its own process (its
`ListBuffer` and `GroupingBuffer` play the part of Dataflow's shuffle service), so its memory grew
with the corpus: ~4 MB per MB of text. Here each bundle's output goes to files as it arrives:

- a plain output (`ListOutput`): the encoded chunks a worker sends, appended to one file;
- a grouping output (`GroupOutput`): each element's encoded key and its encoded bytes, sorted by
  key (stable: arrival order within a key) and written as a *run*; a bundle whose output exceeds
  the sort buffer writes several runs.

A stage's input is then read back lazily: a plain input chunk by chunk (`ListSpill`), a grouping
input as a k-way merge of its runs, one key at a time (`GroupSpill`), so the runner holds a bundle
and the merge's read buffers, whatever the corpus size. Groups are encoded by Beam's own
`GroupingBuffer` (a small one per bundle), so windowing and triggers are Beam's, byte for byte.

Order is deterministic: runs are merged in bundle order and keys come out sorted, so a stage's
input, and so its bundles, are the same in a rerun that reads the same files (resume depends on
it, `pipelines.local.runner`). The job's output never depends on order (`pipelines.prepare`).
"""

from __future__ import annotations

import heapq
import os
import struct
from collections.abc import Iterator
from typing import Any, BinaryIO

from apache_beam.coders.coder_impl import create_InputStream
from apache_beam.runners.portability.fn_api_runner.execution import GroupingBuffer

# Runs merged at once: each open run holds a read buffer; more runs are merged in passes first.
MERGE_FAN_IN = 64
READ_BUFFER_BYTES = 256 << 10
_LENGTH = struct.Struct(">I")


class SpillFiles:
    """Files shared by copies of one spilled PCollection: deleted when the last holder is done."""

    def __init__(self, paths: list[str], keep: bool = False):
        self.paths = paths
        self.keep = keep  # until the run ends (the work directory goes then)
        self._holders = 1

    def share(self) -> SpillFiles:
        self._holders += 1
        return self

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and not self.keep:
            for path in self.paths:
                if os.path.exists(path):
                    os.remove(path)


def element_spans(data: bytes, coder_impl) -> Iterator[tuple[int, int, Any]]:
    """(start, end, decoded value) of each nested-encoded element of a data chunk."""
    stream = create_InputStream(data)
    total = len(data)
    while stream.size() > 0:
        start = total - stream.size()
        value = coder_impl.decode_from_stream(stream, True)
        yield start, total - stream.size(), value


# --------------------------------------------------------------------------- writing


class ListOutput:
    """One bundle's chunks of a plain PCollection, appended to `path`."""

    def __init__(self, path: str):
        self.path = path
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed by finish()
        self.lengths: list[int] = []

    def append(self, data: bytes) -> None:
        self._file.write(data)
        self.lengths.append(len(data))

    def finish(self) -> dict:
        _close_durably(self._file)
        return {"kind": "list", "files": [[os.path.basename(self.path), self.lengths]]}

    def abandon(self) -> None:
        self._file.close()


class GroupOutput:
    """One bundle's elements of a grouping, as sorted runs of (key, element) records."""

    def __init__(self, path_prefix: str, pre_grouped_coder, sort_buffer_bytes: int):
        self._prefix = path_prefix
        self._coder_impl = pre_grouped_coder.get_impl()
        self._key_coder_impl = pre_grouped_coder.key_coder().get_impl()
        self._sort_buffer_bytes = sort_buffer_bytes
        self._records: list[tuple[bytes, bytes]] = []
        self._buffered = 0
        self.runs: list[str] = []

    def append(self, data: bytes) -> None:
        key_encode = self._key_coder_impl.encode
        for start, end, windowed_kv in element_spans(data, self._coder_impl):
            key = key_encode(windowed_kv.value[0])
            self._records.append((key, data[start:end]))
            self._buffered += len(key) + end - start
        if self._buffered >= self._sort_buffer_bytes:
            self._write_run()

    def _write_run(self) -> None:
        path = f"{self._prefix}.run{len(self.runs)}"
        self._records.sort(key=lambda record: record[0])  # stable: arrival order within a key
        with open(path, "wb") as f:
            write_records(f, self._records)
            _close_durably(f)
        self.runs.append(path)
        self._records, self._buffered = [], 0

    def finish(self) -> dict:
        if self._records:
            self._write_run()
        return {"kind": "group", "runs": [os.path.basename(p) for p in self.runs]}

    def abandon(self) -> None:
        self._records = []


def write_records(f: BinaryIO, records) -> None:
    pack = _LENGTH.pack
    for key, element in records:
        f.write(pack(len(key)) + key + pack(len(element)) + element)


def read_records(path: str) -> Iterator[tuple[bytes, bytes]]:
    with open(path, "rb", buffering=READ_BUFFER_BYTES) as f:
        while header := f.read(4):
            key = f.read(_LENGTH.unpack(header)[0])
            element = f.read(_LENGTH.unpack(f.read(4))[0])
            yield key, element


def _close_durably(f: BinaryIO) -> None:
    """Flushed to the disk before a bundle counts as done: a reboot must not lose a done bundle."""
    f.flush()
    os.fsync(f.fileno())
    f.close()


# --------------------------------------------------------------------------- reading


class _Spilled:
    """Beam's buffer protocol (iteration, partition, clear) for what Beam's runner does with a
    spilled PCollection besides bundling it: side inputs read it whole."""

    cleared = False
    spills: list[SpillFiles]

    def __iter__(self) -> Iterator[bytes]:
        raise NotImplementedError

    def partition(self, n: int) -> list[list[bytes]]:
        chunks = list(self)
        return [chunks[k::n] for k in range(n)]

    def release(self) -> None:
        """A reader is done: the files go once every holder is."""
        for spill in self.spills:
            spill.release()

    def clear(self) -> None:
        pass

    def reset(self) -> None:
        pass


class ListSpill(_Spilled):
    """A plain PCollection on disk: chunks in files, in bundle order."""

    def __init__(self, files: list[tuple[str, list[int]]], coder_impl, spills: list[SpillFiles]):
        self.files = files  # [(path, chunk lengths)]
        self.coder_impl = coder_impl
        self.spills = spills

    @property
    def num_bytes(self) -> int:
        return sum(sum(lengths) for _, lengths in self.files)

    def chunks(self) -> Iterator[bytes]:
        for path, lengths in self.files:
            with open(path, "rb", buffering=0) as f:
                for length in lengths:
                    yield f.read(length)

    def parts(self, max_bytes: int) -> Iterator[tuple[list[bytes], int]]:
        """([chunk], size) of whole elements: a chunk as it is, or cut at element boundaries."""
        for chunk in self.chunks():
            if len(chunk) <= max_bytes:
                yield [chunk], len(chunk)
                continue
            piece_start = piece_end = 0
            for start, end, _ in element_spans(chunk, self.coder_impl):
                if end - piece_start > max_bytes and start > piece_start:
                    yield [chunk[piece_start:start]], start - piece_start
                    piece_start = start
                piece_end = end
            yield [chunk[piece_start:piece_end]], piece_end - piece_start

    def __iter__(self) -> Iterator[bytes]:
        return self.chunks()

    def extend(self, other) -> None:
        assert isinstance(other, ListSpill), f"cannot extend a spilled list with {other!r}"
        self.files = self.files + other.files
        self.spills = self.spills + other.spills

    def copy(self) -> ListSpill:
        return ListSpill(list(self.files), self.coder_impl, [s.share() for s in self.spills])



class GroupSpill(_Spilled):
    """A grouping's input on disk: sorted runs, merged into (key, elements) one key at a time."""

    def __init__(self, runs: list[str], pre_grouped_coder, post_grouped_coder, windowing,
                 spills: list[SpillFiles]):
        self.runs = runs
        self.coders = (pre_grouped_coder, post_grouped_coder, windowing)
        self.spills = spills

    @property
    def num_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.runs if os.path.exists(p))

    def groups(self) -> Iterator[tuple[bytes, list[bytes]]]:
        """(encoded key, its elements' bytes) in key order."""
        runs, made = list(self.runs), []
        try:
            while len(runs) > MERGE_FAN_IN:
                runs = self._merge_level(runs, made)
            key, elements = None, []
            for record_key, element in _merge(runs):
                if record_key != key and elements:
                    yield key, elements
                    elements = []
                key = record_key
                elements.append(element)
            if elements:
                yield key, elements
        finally:
            for path in made:
                if os.path.exists(path):
                    os.remove(path)

    @staticmethod
    def _merge_level(runs: list[str], made: list[str]) -> list[str]:
        """Consecutive `MERGE_FAN_IN`s of runs merged into one run each (the order of runs, and so
        of a key's elements, kept): every record is written once per level, log(runs) levels.
        A merged run of the level before goes once merged again; the bundles' own runs stay
        until the stage is done (a rerun after a kill merges them again)."""
        merged_runs = []
        for start in range(0, len(runs), MERGE_FAN_IN):
            batch = runs[start:start + MERGE_FAN_IN]
            if len(batch) == 1:
                merged_runs.append(batch[0])
                continue
            merged = f"{batch[0]}.merged{len(made)}"
            with open(merged, "wb") as f:
                write_records(f, _merge(batch))
            made.append(merged)
            merged_runs.append(merged)
            for path in batch:
                if path in made:
                    os.remove(path)
        return merged_runs

    def parts(self, max_bytes: int) -> Iterator[tuple[list[bytes], int]]:
        """Groups packed `max_bytes` at a time, each encoded as Beam's GroupingBuffer encodes it.

        A key's elements are never cut, so a part may exceed max_bytes by one group.
        """
        batch, size = [], 0
        for key, elements in self.groups():
            group_size = len(key) + sum(map(len, elements))
            if batch and size + group_size > max_bytes:
                yield self._encode(batch), size
                batch, size = [], 0
            batch.extend(elements)
            size += group_size
        if batch:
            yield self._encode(batch), size

    def _encode(self, elements: list[bytes]) -> list[bytes]:
        pre, post, windowing = self.coders
        grouping = GroupingBuffer(pre, post, windowing)
        grouping.append(b"".join(elements))  # keys in order of first appearance: merge order
        return grouping.partition(1)[0]

    def __iter__(self) -> Iterator[bytes]:
        for chunks, _ in self.parts(READ_BUFFER_BYTES):
            yield from chunks

    def extend(self, other) -> None:
        assert isinstance(other, GroupSpill), f"cannot extend a spilled grouping with {other!r}"
        self.runs = self.runs + other.runs
        self.spills = self.spills + other.spills

    def copy(self) -> GroupSpill:
        pre, post, windowing = self.coders
        return GroupSpill(list(self.runs), pre, post, windowing, [s.share() for s in self.spills])



def _merge(runs: list[str]) -> Iterator[tuple[bytes, bytes]]:
    """Records of sorted runs in key order; equal keys in run order (heapq.merge is stable)."""
    return heapq.merge(*(read_records(path) for path in runs), key=lambda record: record[0])

