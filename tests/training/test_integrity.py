"""Integrity: every row checked as it is read, shard checksums verified in the background."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest

from bertforge.pipelines.contract import manifest as manifest_lib
from bertforge.training.data import PretrainingLoader, ReadOptions
from bertforge.training.data.checksums import ChecksumMismatchError, verify_in_background
from bertforge.training.data.integrity import CorruptRowError, FlatRows, RowRules, row_problems
from bertforge.training.errors import UserInputError
from tests.training.conftest import write_dataset

RULES = RowRules(vocab_size=50, max_seq_length=16, cls_id=2, sep_id=3)
GOOD = [2, 7, 8, 3, 9, 3]  # [CLS] a a [SEP] b [SEP], num_a_tokens 4


def problems(ids, num_a=4, label=0):
    """A record batch of two rows, GOOD and `ids`, checked as the loader checks one."""
    rows = FlatRows(offsets=np.array([0, len(GOOD), len(GOOD) + len(ids)], dtype=np.int32),
                    values=np.array(GOOD + ids, dtype=np.int32),
                    num_a_tokens=np.array([4, num_a], dtype=np.uint16),
                    next_sentence_label=np.array([0, label], dtype=np.int8))
    bad, reasons = row_problems(rows, RULES)
    return bad.tolist(), " ".join(reasons)


def test_valid_rows_pass_and_each_broken_field_is_named():
    assert problems(GOOD) == ([False, False], "")
    assert problems([2, 7, 8, 3, 60, 3]) == ([False, True],
                                             "token id 60 outside the vocabulary of 50")
    assert problems([2, 7, -1, 3, 9, 3])[1] == "token id -1 outside the vocabulary of 50"
    assert "length 17 outside [5, 16]" in problems([2] + [7] * 14 + [3, 3], num_a=3)[1]
    assert "num_a_tokens 5 outside [3, length - 2 = 4]" in problems(GOOD, num_a=5)[1]
    assert "num_a_tokens 2 outside" in problems(GOOD, num_a=2)[1]
    assert "next_sentence_label -1 not 0 or 1" in problems(GOOD, label=-1)[1]
    # num_a_tokens in range but not at a [SEP]: the segments would be cut mid-sentence.
    assert problems(GOOD, num_a=3)[1] == (
        "[CLS]/[SEP] are not where num_a_tokens and the length put them")
    assert problems([7, 7, 8, 3, 9, 3])[0] == [False, True]  # no [CLS] first
    assert problems([2, 7, 8, 3, 9, 9])[0] == [False, True]  # no [SEP] last


def shard_path(data_dir: str, index: int = 1) -> str:
    entry = manifest_lib.read_manifest(data_dir).splits["train"].shards[index]
    return os.path.join(data_dir, entry.path)


def flip_64_bytes_of_tokens(path: str) -> int:
    """XOR 64 bytes in the middle of the shard's token ids with 0xFF (the issue's byte flip,
    placed inside one record batch's token ids so the file stays readable Arrow); returns the
    first row of the file it damages."""
    reader = pa.ipc.open_file(path)
    table = reader.read_all()
    # The second row of the middle record batch: the 64 bytes stay inside that batch's ids
    # (the fixture's batches hold 7 rows of at least 8 tokens).
    sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    row = sum(sizes[: len(sizes) // 2]) + 1
    ids = np.array(table.column(manifest_lib.INPUT_IDS)[row].as_py(), dtype=np.uint16)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    start = data.find(ids.tobytes())
    assert start > 0, "the row's ids were not found in the file"
    for i in range(start + 2, start + 66):  # past [CLS]: 32 ids of this row and the next
        data[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    return row


@pytest.fixture
def flipped(tmp_path):
    data_dir = write_dataset(str(tmp_path / "data"), {"train": [23, 40, 30], "validation": [13]})
    path = shard_path(data_dir)
    return data_dir, path, flip_64_bytes_of_tokens(path)


def whole_epoch(loader: PretrainingLoader) -> int:
    return sum(1 for _ in loader)


def test_byte_flip_is_refused_by_checksum_naming_the_file(flipped):
    data_dir, path, _ = flipped
    check = verify_in_background([(path, manifest_lib.read_manifest(data_dir)
                                   .splits["train"].shards[1].sha256)])
    with pytest.raises(ChecksumMismatchError, match=f"shard {path} does not match its sha256"):
        check.wait()
    loader = PretrainingLoader(data_dir, batch_size=4, seed=0, prefetch=0)
    with pytest.raises(UserInputError, match=os.path.basename(path)):
        loader.wait_for_checksums()


def test_byte_flip_without_checksums_is_refused_by_row_validation(flipped):
    """Verification opted out: the first batch holding a damaged row fails, naming the file
    and the row, before the model could index its embedding with the id."""
    data_dir, path, first_damaged = flipped
    loader = PretrainingLoader(data_dir, batch_size=4, seed=0, prefetch=0,
                               read=ReadOptions(verify_checksums=False))
    with pytest.raises(CorruptRowError) as caught:
        whole_epoch(loader)
    message = str(caught.value)
    assert f"shard {path} row " in message and "outside the vocabulary of" in message
    row = int(message.split(" row ")[1].split()[0])
    assert row in (first_damaged, first_damaged + 1)  # the 64 bytes span two rows at most
    # The same position again (as a resume would): the same clear error, not an IndexError.
    with pytest.raises(CorruptRowError, match=f"row {row} "):
        whole_epoch(loader)


def test_clean_data_passes_and_each_file_is_hashed_once_per_process(tmp_path):
    data_dir = write_dataset(str(tmp_path / "data"))
    loader = PretrainingLoader(data_dir, batch_size=4, seed=0, prefetch=0)
    assert whole_epoch(loader) == len(loader)
    loader.wait_for_checksums()
    shards = manifest_lib.read_manifest(data_dir).splits["train"].shards
    files = [(os.path.join(data_dir, entry.path), entry.sha256) for entry in shards]
    first, again = verify_in_background(files), verify_in_background(files)
    assert first.done  # the loader's verdicts, not new hashes
    assert all(a is b for a, b in zip(first._pending, again._pending, strict=True))


def test_hash_failure_other_than_oserror_makes_wait_raise(tmp_path, monkeypatch):
    # Before the fix the futures stayed unresolved and wait() (before every checkpoint) hung.
    from bertforge.training.data import checksums

    def broken_hash(path):
        raise ValueError("hash exploded")

    monkeypatch.setattr(checksums, "sha256_file", broken_hash)
    shard = tmp_path / "a.arrow"
    shard.write_bytes(b"x")
    check = verify_in_background([(str(shard), "0" * 64)])
    waiter = ThreadPoolExecutor(1).submit(check.wait)
    with pytest.raises(ValueError, match="hash exploded"):
        waiter.result(timeout=10)


def test_thread_start_failure_resolves_the_futures(tmp_path, monkeypatch):
    from bertforge.training.data import checksums

    def no_threads(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(checksums.threading.Thread, "start", no_threads)
    shard = tmp_path / "b.arrow"
    shard.write_bytes(b"y")
    with pytest.raises(RuntimeError, match="start new thread"):
        verify_in_background([(str(shard), "1" * 64)])
    monkeypatch.undo()
    check = verify_in_background([(str(shard), "1" * 64)])  # the cached verdict: no hang
    with pytest.raises(RuntimeError, match="start new thread"):
        check.wait()
