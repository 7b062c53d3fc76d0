import io
import os
import random

import numpy as np
import pyarrow as pa
import pytest

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.write import global_order as shards_module
from bertforge.pipelines.write.global_order import (
    boundary_ranks,
    bucket_of,
    concat_shard,
    locate_boundaries,
    piece_starts,
    shard_of,
    write_shard,
)


def _assign(keys: list, num_shards: int) -> list[int]:
    """The job's three steps on one machine: bucket counts, boundary keys, binary search."""
    counts: dict[int, int] = {}
    for key in keys:
        counts[bucket_of(key[0])] = counts.get(bucket_of(key[0]), 0) + 1
    located = locate_boundaries(counts, num_shards)
    boundary_keys = []
    for bucket, ranks in located.items():
        in_bucket = sorted(k for k in keys if bucket_of(k[0]) == bucket)
        boundary_keys += [in_bucket[r] for r in ranks]
    boundary_keys.sort()
    return [shard_of(key, boundary_keys) for key in keys]


@pytest.mark.parametrize(
    "num_rows,num_shards", [(1000, 4), (7, 3), (2, 5), (1, 1), (0, 3), (999, 10)]
)
def test_shard_equals_rank_times_shards_over_rows(num_rows, num_shards):
    rng = random.Random(num_rows)
    # Few distinct high bits, so several boundaries share a bucket.
    keys = [(rng.getrandbits(64) >> rng.choice([0, 50]), f"d{i}", 0, i) for i in range(num_rows)]
    shards = _assign(keys, num_shards)
    rank = {key: r for r, key in enumerate(sorted(keys))}
    assert shards == [rank[key] * num_shards // num_rows for key in keys]
    sizes = np.bincount(shards, minlength=num_shards) if shards else np.zeros(num_shards)
    assert sizes.max() - sizes.min() <= 1


def test_boundary_ranks():
    assert boundary_ranks(10, 4) == [3, 5, 8]
    assert boundary_ranks(2, 4) == [1, 1]  # shards 1 and 2 start at rank 1: shard 1 is empty
    assert boundary_ranks(0, 3) == []


@pytest.mark.parametrize("vocab_size,id_type", [(30522, pa.uint16()), (70_000, pa.int32())])
def test_write_shard_round_trip(vocab_size, id_type):
    dtype = np.uint16 if id_type == pa.uint16() else np.int32
    rows = [(np.array([2, 10, 3, 11, 12, 3], dtype=dtype).tobytes(), 3, 0, "doc:0")] * 5000
    rows.append((np.array([2, 69_999 % vocab_size, 3, 5, 3], dtype=dtype).tobytes(), 3, 1, "doc:1"))
    sink = io.BytesIO()
    assert write_shard(sink, iter(rows), vocab_size) == (5001, 5000 * 6 + 5)
    table = pa.ipc.open_file(pa.BufferReader(sink.getvalue())).read_all()
    assert table.schema == manifest.shard_schema(vocab_size)
    assert table.schema.field("input_ids").type == pa.list_(id_type)
    assert table.num_rows == 5001
    assert table.slice(5000).to_pylist() == [
        {
            "input_ids": [2, 69_999 % vocab_size, 3, 5, 3],
            "num_a_tokens": 3,
            "next_sentence_label": 1,
            "doc_id": "doc:1",
        }
    ]


def test_write_empty_shard_is_a_valid_file():
    sink = io.BytesIO()
    assert write_shard(sink, iter([]), 100) == (0, 0)
    reader = pa.ipc.open_file(pa.BufferReader(sink.getvalue()))
    assert reader.schema == manifest.shard_schema(100) and reader.read_all().num_rows == 0


@pytest.mark.parametrize(
    "num_rows,num_shards,per_piece", [(10, 3, 4), (2, 5, 4), (0, 3, 4), (100, 4, 8), (9, 1, 4)]
)
def test_pieces_cut_shards_into_whole_batches(monkeypatch, num_rows, num_shards, per_piece):
    monkeypatch.setattr(shards_module, "ROWS_PER_BATCH", 4)
    starts = [0] + piece_starts(num_rows, num_shards, per_piece)
    ends = starts[1:] + [num_rows]
    pieces = [range(a, b) for a, b in zip(starts, ends, strict=True) if num_rows]
    assert [r for piece in pieces for r in piece] == list(range(num_rows))
    for piece in pieces:
        shard_ids = {r * num_shards // num_rows for r in piece}
        assert len(shard_ids) == 1 and 0 < len(piece) <= per_piece
        shard_start = -(-min(shard_ids) * num_rows // num_shards)
        assert (piece.start - shard_start) % 4 == 0  # a piece starts on a batch boundary


def test_concatenated_pieces_equal_one_shard_byte_for_byte(monkeypatch):
    monkeypatch.setattr(shards_module, "ROWS_PER_BATCH", 4)
    rng = np.random.default_rng(0)
    rows = [
        (rng.integers(0, 30_000, n).astype(np.uint16).tobytes(), 2, i % 2, f"d{i}")
        for i, n in enumerate(rng.integers(3, 20, 23))
    ]
    whole = io.BytesIO()
    write_shard(whole, iter(rows), 30_522)
    parts = []
    for start in range(0, len(rows), 8):  # pieces of two batches, the last one partial
        part = io.BytesIO()
        write_shard(part, iter(rows[start : start + 8]), 30_522)
        parts.append(io.BytesIO(part.getvalue()))
    joined = io.BytesIO()
    concat_shard(joined, parts, 30_522)
    assert joined.getvalue() == whole.getvalue()
    empty, reference = io.BytesIO(), io.BytesIO()
    concat_shard(empty, [], 30_522)
    write_shard(reference, iter([]), 30_522)
    assert empty.getvalue() == reference.getvalue()


def _piece_files(folder, rows_per_piece: list[int]) -> list[tuple]:
    """Pieces of shard 0 of one as WritePieceFile leaves them: (piece, path, rows, tokens)."""
    rng = np.random.default_rng(1)
    pieces = []
    for piece, num_rows in enumerate(rows_per_piece):
        rows = [(rng.integers(5, 300, 9).astype(np.uint16).tobytes(), 3, 0, f"d{piece}-{i}")
                for i in range(num_rows)]
        path = folder / f"part-00000-of-00001.arrow.piece{piece}-x.tmp"
        with open(path, "wb") as f:
            write_shard(f, iter(rows), 320)
        pieces.append((piece, str(path), num_rows, 9 * num_rows))
    return pieces


def test_a_shard_redone_after_a_kill_past_its_rename_gives_the_same_entry(tmp_path):
    """A kill after WriteShardFile renamed the shard and deleted its pieces, before the bundle
    counted as done: the same command redoes the bundle. It failed on the pieces gone, on
    every rerun (only --overwrite went on); it takes the shard that attempt wrote."""
    from bertforge.pipelines.write.shards_transform import WriteShardFile

    (tmp_path / "train").mkdir()
    pieces = _piece_files(tmp_path / "train", [5, 7])
    step = WriteShardFile(str(tmp_path), 320, {"train": 1})
    first = list(step.process((("train", 0), pieces)))
    assert not [p for p in os.listdir(tmp_path / "train") if "piece" in p]
    again = list(step.process((("train", 0), pieces)))  # the redo: pieces gone
    assert again == first and first[0]["num_rows"] == 12

    # Some pieces left (killed within the delete): the shard is taken, the rest deleted.
    pieces = _piece_files(tmp_path / "train", [5, 7])
    os.remove(pieces[0][1])
    assert list(step.process((("train", 0), pieces))) == first
    assert not [p for p in os.listdir(tmp_path / "train") if "piece" in p]


def test_a_shard_of_other_rows_is_not_taken_for_a_redone_one(tmp_path):
    """A piece gone and the shard's name holding other rows (an older dataset's): no shard is
    made up from it; the missing piece is named."""
    from bertforge.pipelines.write.shards_transform import WriteShardFile

    (tmp_path / "train").mkdir()
    old = _piece_files(tmp_path / "train", [3])
    list(WriteShardFile(str(tmp_path), 320, {"train": 1}).process((("train", 0), old)))
    pieces = _piece_files(tmp_path / "train", [5, 7])
    os.remove(pieces[1][1])
    with pytest.raises(Exception, match="piece1"):
        list(WriteShardFile(str(tmp_path), 320, {"train": 1}).process((("train", 0), pieces)))


def test_shards_and_the_manifest_are_on_the_disk_before_anything_vouches_for_them(
        tmp_path, monkeypatch):
    """A shard's bundle counts as done (a synced record) and the manifest says the dataset is
    finished: without an fsync of the shard and of the manifest a power loss could keep those
    records and lose the bytes, and the same command then took the damaged dataset as done."""
    from bertforge.pipelines.filesystem import write_bytes
    from bertforge.pipelines.instances.batch_columns import InstanceBatch
    from bertforge.pipelines.write.shards_transform import WritePieceFile, WriteShardFile

    synced: set[int] = set()
    fsync = os.fsync

    def recording_fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    (tmp_path / "train").mkdir()
    batch = InstanceBatch("train", np.array([7, 3], dtype=np.uint64), ("a:0", "a:1"),
                          np.zeros(2, np.int32), np.arange(2, dtype=np.int32),
                          np.array([2, 5, 3, 2, 6, 3, 3] * 2, dtype=np.int32),
                          np.array([7, 7], dtype=np.int32), np.array([3, 3], dtype=np.uint16),
                          np.zeros(2, np.int8))
    (_, (_, piece, _, _)), = WritePieceFile(str(tmp_path), 320, {"train": 1}).process(
        (("train", 0, 0), [batch]))
    assert os.stat(piece).st_ino in synced, "a piece"
    pieces = _piece_files(tmp_path / "train", [5])
    list(WriteShardFile(str(tmp_path), 320, {"train": 1}).process((("train", 0), pieces)))
    write_bytes(str(tmp_path / "vocab.txt"), b"[PAD]\n")
    found = manifest.Manifest(manifest.TokenizerEntry("0", 320, True), {}, {}, {})
    manifest.write_manifest(str(tmp_path), found)
    for name in ("train/part-00000-of-00001.arrow", "vocab.txt", "manifest.json"):
        assert os.stat(tmp_path / name).st_ino in synced, name
