"""The loader: layout, order, resume, world-size invariance, checks on open."""

from __future__ import annotations

import gc
import os
import pathlib
import shutil
import threading
import time

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from bertforge.pipelines.contract import manifest as manifest_lib
from bertforge.training.data import (
    BucketingOptions,
    MaskingOptions,
    PretrainingLoader,
    ReadOptions,
    download_split,
    padded_width,
    rows_from_sequences,
    token_frequencies,
)
from bertforge.training.errors import UserInputError
from bertforge.training.masking import IGNORE_INDEX
from tests.training.conftest import (
    read_split_rows,
    reference_and_resumed,
    write_dataset,
    write_shard,
)

KEYS = ("input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label")


def restored_rows(batch):
    """Per row: (original ids, num_a_tokens, nsp label) recovered from a masked batch."""
    ids = torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])
    rows = []
    for row in range(len(ids)):
        length = int(batch["attention_mask"][row].sum())
        num_a = length - int(batch["token_type_ids"][row].sum())
        rows.append((ids[row, :length].numpy(), num_a, int(batch["next_sentence_label"][row])))
    return rows


def trimmed(batch):
    """Per row, every field cut to its real tokens: comparable across padding widths."""
    out = []
    for row in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][row].sum())
        out.append(
            tuple(batch[k][row, :length].tolist() for k in KEYS[:4])
            + (int(batch["next_sentence_label"][row]),)
        )
    return out


def all_batches(loader):
    return [b for b in loader]


def assert_batches_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key in KEYS:
            torch.testing.assert_close(g[key], w[key], rtol=0, atol=0)


def test_batch_layout(dataset_dir):
    truth = read_split_rows(dataset_dir, "train")
    loader = PretrainingLoader(dataset_dir, batch_size=8, seed=1)
    order = loader.epoch_order(0)
    for g, batch in enumerate(loader):
        assert set(batch) == set(KEYS)
        assert all(t.dtype == torch.int64 for t in batch.values())
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape[1] == padded_width(int(lengths.max()))
        assert batch["input_ids"].shape[1] % 8 == 0
        pad = ~batch["attention_mask"].bool()
        assert (batch["input_ids"][pad] == 0).all()  # [PAD] is id 0 in this vocab
        assert (batch["labels"][pad] == IGNORE_INDEX).all()
        assert (batch["token_type_ids"][pad] == 0).all()
        indices = loader.rank_indices(order, g)
        for row, (ids, num_a, label) in zip(indices, restored_rows(batch), strict=True):
            want_ids, want_a, want_label = truth[row]
            np.testing.assert_array_equal(ids, want_ids)
            assert (num_a, label) == (want_a, want_label)
        ttype = batch["token_type_ids"][0]
        num_a = truth[loader.rank_indices(order, g)[0]][1]
        assert (ttype[:num_a] == 0).all() and ttype[num_a] == 1
    assert loader.batches_consumed == len(loader) == 70 // 8


def test_every_sample_once_per_epoch_and_epochs_differ(dataset_dir):
    loader = PretrainingLoader(dataset_dir, batch_size=8, seed=1, drop_last=False)
    assert len(loader) == 9  # 70 = 8 x 8 + 6, the partial batch kept
    seen = np.concatenate([loader.rank_indices(loader.epoch_order(0), g) for g in range(9)])
    assert sorted(seen.tolist()) == list(range(70))
    assert sum(len(b["input_ids"]) for b in loader) == 70
    order0 = loader.epoch_order(0)
    np.testing.assert_array_equal(order0, np.random.default_rng([1, 0]).permutation(70))
    loader.set_epoch(1)
    assert not np.array_equal(order0, loader.epoch_order(1))
    # Same samples under another epoch: same ids, other masks.
    first = PretrainingLoader(dataset_dir, batch_size=70, seed=1)
    batch0 = next(iter(first))
    first.set_epoch(1)
    batch1 = next(iter(first))
    order = np.argsort(first.epoch_order(0)), np.argsort(first.epoch_order(1))
    labels0, labels1 = batch0["labels"][order[0]], batch1["labels"][order[1]]
    assert not torch.equal(labels0, labels1)


def test_same_seed_same_batches_other_seed_others(dataset_dir):
    a = all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=3))
    b = all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=3, prefetch=0))
    assert_batches_equal(a, b)
    c = all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=4))
    assert [trimmed(x) for x in a] != [trimmed(x) for x in c]


def test_stops_at_epoch_end_and_set_epoch(dataset_dir):
    loader = PretrainingLoader(dataset_dir, batch_size=16, seed=0)
    assert len(all_batches(loader)) == 4
    assert all_batches(loader) == []  # exhausted until the next epoch
    loader.set_epoch(0)  # the current epoch: position kept
    assert all_batches(loader) == []
    loader.set_epoch(1)
    assert len(all_batches(loader)) == 4
    assert loader.state_dict()["epoch"] == 1


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_gives_the_remaining_batches(dataset_dir, prefetch):
    reference = PretrainingLoader(dataset_dir, batch_size=4, seed=5, prefetch=prefetch)
    reference.set_epoch(2)
    want = all_batches(reference)
    interrupted = PretrainingLoader(dataset_dir, batch_size=4, seed=5, prefetch=prefetch)
    interrupted.set_epoch(2)
    iterator = iter(interrupted)
    for _ in range(5):
        next(iterator)
    state = interrupted.state_dict()  # prefetched batches do not count
    assert (state["epoch"], state["batches_consumed"]) == (2, 5)
    del iterator
    resumed = PretrainingLoader(dataset_dir, batch_size=4, seed=5, prefetch=prefetch)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a loop may call it blindly
    assert_batches_equal(all_batches(resumed), want[5:])


def test_resume_at_epoch_end_starts_the_next_epoch(dataset_dir):
    loader = PretrainingLoader(dataset_dir, batch_size=16, seed=0)
    all_batches(loader)
    resumed = PretrainingLoader(dataset_dir, batch_size=16, seed=0)
    resumed.load_state_dict(loader.state_dict())
    loader.set_epoch(1)
    assert_batches_equal(all_batches(resumed), all_batches(loader))


def test_resume_with_another_global_batch_needs_a_boundary(dataset_dir):
    saver = PretrainingLoader(dataset_dir, batch_size=4, seed=5)
    for _, _batch in zip(range(3), saver, strict=False):
        pass
    state = saver.state_dict()
    assert (state["samples_consumed"], state["batches_consumed"]) == (12, 3)
    with pytest.raises(ValueError, match=r"after 12 samples .*every 2 batches"):
        PretrainingLoader(dataset_dir, batch_size=8, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PretrainingLoader(dataset_dir, batch_size=4, seed=6).load_state_dict(state)
    next(iter(saver))  # 16 samples: a boundary of a global batch of 8 too
    resumed = PretrainingLoader(dataset_dir, batch_size=8, seed=5)
    resumed.load_state_dict(saver.state_dict())
    assert resumed.batches_consumed == 2
    # What is no saved state: {} was a KeyError of 'seed', None an AttributeError, an epoch
    # of -3 taken until the next iter().
    with pytest.raises(TypeError, match="a loader state is the dict state_dict\\(\\) returned, "
                       "got NoneType"):
        resumed.load_state_dict(None)
    with pytest.raises(ValueError, match="not a loader state: it lacks epoch, seed"):
        resumed.load_state_dict({})
    with pytest.raises(ValueError, match="epoch is an int >= 0, got -3"):
        resumed.load_state_dict({**saver.state_dict(), "epoch": -3})


def test_world_size_does_not_change_global_batches(dataset_dir):
    single = all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=2))
    ranks = [
        all_batches(PretrainingLoader(dataset_dir, batch_size=4, seed=2, rank=r, world_size=2))
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1]) == len(single)
    for g, whole in enumerate(single):
        assert trimmed(ranks[0][g]) + trimmed(ranks[1][g]) == trimmed(whole)


def test_resume_from_two_ranks_on_one(dataset_dir):
    single = all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=2))
    rank0 = PretrainingLoader(dataset_dir, batch_size=4, seed=2, rank=0, world_size=2)
    for _, _batch in zip(range(3), rank0, strict=False):
        pass
    resumed = PretrainingLoader(dataset_dir, batch_size=8, seed=2)
    resumed.load_state_dict(rank0.state_dict())
    rest = all_batches(resumed)
    assert [trimmed(b) for b in rest] == [trimmed(b) for b in single[3:]]


def test_partial_last_batch_split_across_ranks(dataset_dir):
    # 70 = 4 x 16 + 6: the last global batch has 6 rows, 3 per rank.
    loaders = [
        PretrainingLoader(dataset_dir, batch_size=8, seed=0, rank=r, world_size=2, drop_last=False)
        for r in range(2)
    ]
    last = [all_batches(loader)[-1] for loader in loaders]
    assert [len(b["input_ids"]) for b in last] == [3, 3]


def test_prefetch_thread_stops(dataset_dir):
    def prefetchers():
        return [t for t in threading.enumerate() if t.name == "bertforge-prefetch"]

    loader = PretrainingLoader(dataset_dir, batch_size=4, seed=0, prefetch=2)
    for _ in loader:
        break  # the for loop drops the iterator: its thread must end
    gc.collect()
    assert prefetchers() == []
    iterator = iter(loader)
    next(iterator)
    loader.set_epoch(3)  # moving the loader closes the live iterator
    assert prefetchers() == []
    with pytest.raises(StopIteration):
        next(iterator)
    assert loader.state_dict()["batches_consumed"] == 0


def test_a_newer_iterator_takes_over_and_the_older_one_says_so(dataset_dir):
    """The loader has one position: two iterators interleaved would each skip the other's
    batches. The older one ended quietly, an epoch cut short without a word; now it raises."""
    loader = PretrainingLoader(dataset_dir, batch_size=4, seed=0, prefetch=2)
    first = iter(loader)
    taken = next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match=r"a newer iter\(\) of this PretrainingLoader took "
                       "over its position"):
        next(first)
    rest = list(second)  # the newer one goes on from the older one's position
    assert len(rest) == len(loader) - 1
    assert not any(torch.equal(taken["input_ids"], b["input_ids"]) for b in rest
                   if b["input_ids"].shape == taken["input_ids"].shape)
    assert loader.state_dict()["batches_consumed"] == len(loader)
    iter(loader)  # an iterator that had ended stays ended
    with pytest.raises(StopIteration):
        next(second)


def test_validation_split_and_frequencies(dataset_dir):
    loader = PretrainingLoader(dataset_dir, "validation", batch_size=5, seed=0, drop_last=False)
    assert sum(len(b["input_ids"]) for b in loader) == 13
    # A user's error (not retried on a cluster) that says which flags to change.
    with pytest.raises(UserInputError, match="fewer than one optimizer step.*--batch-size.*"
                       "drop_last=False serves every sample"):
        PretrainingLoader(dataset_dir, "validation", batch_size=16, seed=0)
    # The Python API's arguments of the wrong type, at once (None and 1.5 failed at the first
    # batch, inside a comparison or numpy).
    for given, name in (({"seed": None}, "seed"), ({"seed": 1.5}, "seed"),
                        ({"batch_size": 2.0}, "batch_size"), ({"rank": True}, "rank")):
        with pytest.raises(TypeError, match=f"{name} must be an int, got {given[name]!r}"):
            PretrainingLoader(dataset_dir, "validation", **{"batch_size": 5, "seed": 0, **given})
    with pytest.raises(ValueError, match="no split 'test'"):
        PretrainingLoader(dataset_dir, "test", batch_size=1, seed=0)
    # Taken or failing late before: "no" as True, whole-word masking on for "no", an epoch of
    # 1.5 at the next iter(); a pathlib.Path failed inside a string test.
    with pytest.raises(TypeError, match="drop_last must be True or False, got 'no'"):
        PretrainingLoader(dataset_dir, batch_size=5, seed=0, drop_last="no")
    for given, message in (({"whole_word": "no"}, "whole_word must be True or False"),
                           ({"max_predictions": 2.5}, "max_predictions must be an int or None")):
        with pytest.raises(TypeError, match=message):
            MaskingOptions(**given)
    with pytest.raises(TypeError, match="epoch must be an int, got 1.5"):
        loader.set_epoch(1.5)
    assert len(PretrainingLoader(pathlib.Path(dataset_dir), batch_size=5, seed=0)) == len(
        PretrainingLoader(dataset_dir, batch_size=5, seed=0))
    counts = token_frequencies(dataset_dir, "train")
    want = np.bincount(np.concatenate([r[0] for r in read_split_rows(dataset_dir, "train")]))
    np.testing.assert_array_equal(counts[: len(want)], want)
    assert counts.sum() == want.sum() and len(counts) == loader.vocab_size


def test_rows_from_sequences_pads_to_multiples_of_8():
    rows = rows_from_sequences([np.arange(3), np.arange(9)], [2, 4], [0, 1], [10, 11], pad_id=0)
    assert rows.input_ids.shape == (2, 16)
    assert rows.input_ids[1, :9].tolist() == list(range(9))
    assert rows.lengths.tolist() == [3, 9]


@pytest.fixture
def damaged(tmp_path):
    """A fresh dataset the test may break."""
    return write_dataset(str(tmp_path / "data"))


def shard_path(data_dir, index=1):
    manifest = manifest_lib.read_manifest(data_dir)
    return os.path.join(data_dir, manifest.splits["train"].shards[index].path)


def test_missing_manifest_and_shard(damaged):
    path = shard_path(damaged)
    os.remove(path)
    with pytest.raises(FileNotFoundError, match=os.path.basename(path)):
        PretrainingLoader(damaged, batch_size=4, seed=0)
    os.remove(os.path.join(damaged, manifest_lib.MANIFEST_NAME))
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        PretrainingLoader(damaged, batch_size=4, seed=0)


def test_truncated_and_corrupt_shards(damaged):
    path = shard_path(damaged)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{os.path.basename(path)} is corrupt or truncated"):
        PretrainingLoader(damaged, batch_size=4, seed=0)
    with open(path, "wb") as f:
        f.write(b"not arrow at all" * 100)
    with pytest.raises(ValueError, match=os.path.basename(path)):
        PretrainingLoader(damaged, batch_size=4, seed=0)


def test_row_count_and_checksum_mismatch(damaged, tmp_path):
    other = write_dataset(str(tmp_path / "other"), {"train": [23, 9, 30]}, seed=9)
    path = shard_path(damaged)
    shutil.copy(shard_path(other), path)  # 9 rows where the manifest says 17
    with pytest.raises(ValueError, match=f"{os.path.basename(path)} has 9 rows but"):
        PretrainingLoader(damaged, batch_size=4, seed=0)
    other = write_dataset(str(tmp_path / "same-size"), {"train": [23, 17, 30]}, seed=9)
    shutil.copy(shard_path(other), path)  # right row count, other content
    unhashed = ReadOptions(verify_checksums=False)
    PretrainingLoader(damaged, batch_size=4, seed=0, read=unhashed)  # unnoticed without hashing
    loader = PretrainingLoader(damaged, batch_size=4, seed=0)  # hashing in the background
    with pytest.raises(ValueError, match=f"{os.path.basename(path)} does not match its sha256"):
        loader.wait_for_checksums()


def test_an_id_past_the_vocabulary_is_named_by_its_shard_and_row(damaged):
    """eval's baseline said only "split 'train' holds ids past the vocabulary" of a damaged
    file, where `inspect` names the row."""
    import pyarrow as pa

    path = shard_path(damaged)
    table = pa.ipc.open_file(pa.memory_map(path)).read_all()
    ids = table.column(0).to_pylist()
    vocab_size = manifest_lib.read_manifest(damaged).tokenizer.vocab_size
    ids[9][2] = vocab_size + 7  # row 9: the second record batch's third row (7 a batch)
    rows = [(row, a, nsp) for row, a, nsp in zip(ids, table.column(1).to_pylist(),
                                                  table.column(2).to_pylist(), strict=True)]
    write_shard(path, rows, table.schema)
    with pytest.raises(ValueError, match=f"^shard {path}, row 9: token id {vocab_size + 7} is "
                       f"past the vocabulary's {vocab_size} entries"):
        token_frequencies(damaged, "train")


def test_vocabulary_mismatch(dataset_dir):
    sha = manifest_lib.read_manifest(dataset_dir).tokenizer.vocab_sha256
    same = ReadOptions(expected_vocab_sha256=sha)
    other = ReadOptions(expected_vocab_sha256="0" * 64)
    PretrainingLoader(dataset_dir, batch_size=4, seed=0, read=same)
    with pytest.raises(ValueError, match="does not match the model's"):
        PretrainingLoader(dataset_dir, batch_size=4, seed=0, read=other)


def test_remote_dataset_is_copied_then_mapped(dataset_dir, tmp_path):
    remote = pafs.SubTreeFileSystem(dataset_dir, pafs.LocalFileSystem())  # stands in for gs://
    local = download_split(remote, "", "train", cache_dir=str(tmp_path / "cache"))
    assert download_split(remote, "", "train", cache_dir=str(tmp_path / "cache")) == local
    copied = all_batches(PretrainingLoader(local, batch_size=8, seed=1))
    assert_batches_equal(copied, all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=1)))
    uri = PretrainingLoader("file://" + os.path.abspath(dataset_dir), batch_size=8, seed=1)
    assert len(uri) == 8


def test_errors_in_the_prefetch_thread_reach_the_consumer(dataset_dir, monkeypatch):
    loader = PretrainingLoader(dataset_dir, batch_size=4, seed=0, prefetch=2)

    def broken(rows, epoch):
        raise RuntimeError("collation failed")

    monkeypatch.setattr(loader, "collator", broken)
    with pytest.raises(RuntimeError, match="collation failed"):
        next(iter(loader))
    assert loader.batches_consumed == 0


def test_a_rank_may_get_an_empty_last_batch(dataset_dir):
    # 13 = 1 x 12 + 1: the last global batch has one row, for rank 0 only.
    loaders = [
        PretrainingLoader(
            dataset_dir, "validation", batch_size=4, seed=0, rank=r, world_size=3, drop_last=False
        )
        for r in range(3)
    ]
    last = [all_batches(loader)[-1]["input_ids"].shape for loader in loaders]
    assert last[0][0] == 1 and last[1] == last[2] == (0, 8)


def test_same_epoch_repeats_its_masks(dataset_dir):
    loader = PretrainingLoader(dataset_dir, batch_size=8, seed=1)
    first = all_batches(loader)
    loader.set_epoch(1)
    other = all_batches(loader)
    loader.set_epoch(0)
    assert_batches_equal(all_batches(loader), first)
    assert [trimmed(b) for b in other] != [trimmed(b) for b in first]


def test_filesystem_instead_of_a_uri(dataset_dir, tmp_path):
    # A filesystem object carries what a URI cannot (credentials, endpoints, a sub-tree).
    remote = pafs.SubTreeFileSystem(os.path.abspath(dataset_dir), pafs.LocalFileSystem())
    read = ReadOptions(filesystem=remote, cache_dir=str(tmp_path / "cache"))
    loader = PretrainingLoader("", batch_size=8, seed=1, read=read)
    assert_batches_equal(
        all_batches(loader), all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=1))
    )
    assert os.listdir(tmp_path / "cache")  # copied, then memory-mapped from the copy


# -- gradient accumulation and resume across layouts ---------------------------------------


def per_step(batches, per):
    """Batches grouped `per` at a time (one optimizer step), rows concatenated."""
    rows = [trimmed(b) for b in batches]
    return [sum(rows[i : i + per], []) for i in range(0, len(rows), per)]


def rank_steps(loaders):
    """Per optimizer step (one global batch each), the ranks' rows concatenated in rank order."""
    per_rank = [[trimmed(b) for b in loader] for loader in loaders]
    return [sum(parts, []) for parts in zip(*per_rank, strict=True)]


def test_epoch_ends_at_the_last_full_optimizer_step(dataset_dir):
    # 70 samples, 4 micro x 3 accumulation = 12 a step: 5 steps, 15 batches, 10 samples dropped.
    loader = PretrainingLoader(dataset_dir, batch_size=4, seed=0, gradient_accumulation_steps=3)
    assert (len(loader), loader.step_batch_size) == (15, 12)
    assert len(all_batches(loader)) == 15
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        PretrainingLoader(dataset_dir, batch_size=4, seed=0, gradient_accumulation_steps=0)


BUCKETS = {"bucketing": BucketingOptions(boundaries=(16, 32, 48), window=2)}


@pytest.mark.parametrize("options", [{}, BUCKETS], ids=["plain", "bucketed"])
def test_resume_two_ranks_on_one_with_accumulation(dataset_dir, options):
    """2 ranks x micro 4 x accumulation 1 -> 1 rank x micro 4 x accumulation 2: same steps."""

    def two_ranks():
        return [
            PretrainingLoader(dataset_dir, batch_size=4, seed=2, rank=r, world_size=2, **options)
            for r in range(2)
        ]

    uninterrupted = two_ranks()
    want = rank_steps(uninterrupted)
    for loader in uninterrupted:
        loader.set_epoch(1)
    want_next_epoch = rank_steps(uninterrupted)
    interrupted = two_ranks()
    for loader in interrupted:
        for _, _batch in zip(range(3), loader, strict=False):  # 3 steps of 8 samples
            pass
    states = [loader.state_dict() for loader in interrupted]
    assert states[0] == states[1]  # every rank saves the same position
    resumed = PretrainingLoader(
        dataset_dir, batch_size=4, seed=2, gradient_accumulation_steps=2, **options
    )
    resumed.load_state_dict(states[0])
    assert resumed.batches_consumed == 6
    assert per_step(all_batches(resumed), 2) == want[3:]
    resumed.set_epoch(1)  # epochs end at the same step: the next one matches as a whole
    assert per_step(all_batches(resumed), 2) == want_next_epoch


@pytest.mark.parametrize("options", [{}, BUCKETS], ids=["plain", "bucketed"])
def test_resume_one_rank_with_accumulation_on_two(dataset_dir, options):
    def one_rank():
        return PretrainingLoader(
            dataset_dir, batch_size=4, seed=3, gradient_accumulation_steps=2, **options
        )

    want = per_step(all_batches(one_rank()), 2)
    saver = one_rank()
    iterator = iter(saver)
    for _ in range(3):  # mid-step: 12 samples, not a boundary of a global batch of 8
        next(iterator)
    ranks = [
        PretrainingLoader(dataset_dir, batch_size=4, seed=3, rank=r, world_size=2, **options)
        for r in range(2)
    ]
    with pytest.raises(ValueError, match="every 2 batches of the saving layout"):
        ranks[0].load_state_dict(saver.state_dict())
    next(iterator)
    for loader in ranks:
        loader.load_state_dict(saver.state_dict())
    assert rank_steps(ranks) == want[2:]


@pytest.mark.parametrize("options", [{}, BUCKETS], ids=["plain", "bucketed"])
def test_resume_four_ranks_on_two(dataset_dir, options):
    def layout(world_size):
        micro = 8 // world_size
        return [
            PretrainingLoader(
                dataset_dir, batch_size=micro, seed=4, rank=r, world_size=world_size, **options
            )
            for r in range(world_size)
        ]

    want = rank_steps(layout(4))
    four = layout(4)
    for loader in four:
        for _, _batch in zip(range(5), loader, strict=False):
            pass
    two = layout(2)
    for loader in two:
        loader.load_state_dict(four[0].state_dict())
    assert rank_steps(two) == want[5:]


def test_version_1_states_still_load(dataset_dir):
    want = all_batches(PretrainingLoader(dataset_dir, batch_size=8, seed=5))
    old = {"version": 1, "epoch": 0, "batches_consumed": 3, "seed": 5, "global_batch_size": 8,
           "num_samples": 70, "split": "train"}  # fmt: skip
    resumed = PretrainingLoader(dataset_dir, batch_size=4, seed=5, gradient_accumulation_steps=2)
    resumed.load_state_dict(old)
    assert per_step(all_batches(resumed), 2) == [trimmed(b) for b in want[3:]]
    finished = PretrainingLoader(dataset_dir, batch_size=8, seed=5)
    finished.load_state_dict(old | {"batches_consumed": 8})
    assert finished.epoch == 1 and finished.batches_consumed == 0


# -- length bucketing --------------------------------------------------------------------


def reference_bucketed_order(seed, epoch, lengths, boundaries, step, window):
    """The bucketed order written plainly: windows sorted by bin, steps shuffled per window."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)).tolist()
    full = len(order) // step * step
    out = []
    for start in range(0, full, step * window):
        part = order[start : min(start + step * window, full)]
        part.sort(key=lambda i: sum(lengths[i] > edge for edge in boundaries))  # stable
        steps = [part[k : k + step] for k in range(0, len(part), step)]
        for chosen in rng.permutation(len(steps)):
            out += steps[chosen]
    return out + order[full:]


@pytest.mark.parametrize(
    ("batch_size", "accumulation", "window", "drop_last"),
    [(4, 1, 2, True), (4, 2, 3, True), (8, 1, 1, False), (3, 2, 64, False)],
)
def test_bucketed_order_is_the_reference(dataset_dir, batch_size, accumulation, window, drop_last):
    lengths = [len(r[0]) for r in read_split_rows(dataset_dir, "train")]
    loader = PretrainingLoader(
        dataset_dir,
        batch_size=batch_size,
        seed=7,
        gradient_accumulation_steps=accumulation,
        bucketing=BucketingOptions(boundaries=(16, 32, 48), window=window),
        drop_last=drop_last,
    )
    np.testing.assert_array_equal(loader.sample_lengths(), lengths)
    for epoch in range(3):
        order = loader.epoch_order(epoch)
        step = batch_size * accumulation
        want = reference_bucketed_order(7, epoch, lengths, (16, 32, 48), step, window)
        assert order.tolist() == want
        assert sorted(want) == list(range(70))  # every sample exactly once
    served = sum(len(b["input_ids"]) for b in loader)
    assert served == (len(loader) * batch_size if drop_last else 70)


def test_bucketing_keeps_global_batches_for_any_world_size(dataset_dir):
    def layout(world_size):
        return [
            PretrainingLoader(
                dataset_dir,
                batch_size=8 // world_size,
                seed=2,
                rank=r,
                world_size=world_size,
                bucketing=BucketingOptions(num_buckets=4, window=3),
            )
            for r in range(world_size)
        ]

    steps = [rank_steps(layout(w)) for w in (1, 2, 4)]
    assert steps[0] == steps[1] == steps[2]
    assert layout(1)[0].bucket_boundaries == (16, 32, 48)  # 4 bins up to 64 tokens


def test_bucketing_resumes_exactly_and_masks_follow_the_sample(dataset_dir):
    options = dict(batch_size=4, seed=5, prefetch=3, **BUCKETS)
    want, resumed = reference_and_resumed(dataset_dir, options, epoch=2, num_batches=5)
    assert_batches_equal(all_batches(resumed), want[5:])
    # Bucketing moves samples, not masks: a sample is masked the same in either order.
    plain = PretrainingLoader(dataset_dir, batch_size=4, seed=5)
    plain.set_epoch(2)
    by_index = {}
    reference = PretrainingLoader(dataset_dir, **options)  # its order, for the sample indices
    for loader, batches in ((plain, all_batches(plain)), (reference, want)):
        order = loader.epoch_order(2)
        for g, batch in enumerate(batches):
            for index, row in zip(loader.rank_indices(order, g), trimmed(batch), strict=True):
                assert by_index.setdefault(int(index), row) == row


def test_bucketing_saves_padding(dataset_dir):
    def padded_and_real(**options):
        loader = PretrainingLoader(dataset_dir, batch_size=4, seed=0, **options)
        padded = real = 0
        for epoch in range(4):
            loader.set_epoch(epoch)
            for batch in loader:
                padded += batch["attention_mask"].numel()
                real += int(batch["attention_mask"].sum())
        return padded, real

    # 70 rows of 8..61 tokens; bins a multiple of 8 wide, 8 steps of 4 sorted together.
    plain = padded_and_real()
    bucketed = padded_and_real(bucketing=BucketingOptions(tuple(range(8, 64, 8)), window=8))
    waste_plain = 1 - plain[1] / plain[0]
    waste_bucketed = 1 - bucketed[1] / bucketed[0]
    assert waste_bucketed < 0.5 * waste_plain, (waste_plain, waste_bucketed)  # 15 % vs 38 %


def test_bucketing_options_are_checked(dataset_dir):
    def loader(**options):
        return PretrainingLoader(dataset_dir, batch_size=4, seed=0, **options)

    for options, message in (
        ({"boundaries": (32, 16)}, "strictly increasing"),
        ({"boundaries": (0, 16)}, "positive"),
        ({"boundaries": ()}, "strictly increasing"),
        ({"boundaries": (16,), "num_buckets": 2}, "not both"),
        ({}, "needs boundaries or num_buckets"),
        ({"num_buckets": 1}, "num_buckets must be >= 2"),
        ({"boundaries": (16,), "window": 0}, "window must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            BucketingOptions(**options)
    state = loader(**BUCKETS).state_dict()
    with pytest.raises(ValueError, match="length bucketing"):
        loader().load_state_dict(state)
    with pytest.raises(ValueError, match="length bucketing"):
        loader(bucketing=BucketingOptions((16, 32, 48), window=3)).load_state_dict(state)
    other_step = PretrainingLoader(
        dataset_dir, batch_size=4, seed=0, gradient_accumulation_steps=2, **BUCKETS
    )
    with pytest.raises(ValueError, match="keep micro-batch x ranks x gradient_accumulation"):
        other_step.load_state_dict(state)


def _copy_on_a_node(rank: int, world_size: int, port: int, dataset_dir: str, tmp: list,
                    results: str, local_ranks: list) -> None:
    """Rank `rank` of a group whose own timeout is 3 s: local rank `local_ranks[rank]` of the
    node whose temporary directory is `tmp[rank]`. The bucket is `dataset_dir`'s parent,
    reached as gs://bucket; rank 0's copy takes 6 s."""
    import tempfile
    import types
    from datetime import timedelta

    import torch.distributed as dist

    from bertforge.training.data import download

    bucket = pafs.SubTreeFileSystem(os.path.dirname(dataset_dir), pafs.LocalFileSystem())
    shim = types.SimpleNamespace(**{name: getattr(pafs, name) for name in dir(pafs)})
    shim.FileSystem = types.SimpleNamespace(
        from_uri=lambda uri: (bucket, uri.removeprefix("gs://bucket/")))
    download.pafs = shim
    if rank == 0:
        real_download = download.download_split

        def slow_download(*args, **kwargs):
            time.sleep(3.0)  # twice: longer than the group's own timeout
            return real_download(*args, **kwargs)

        download.download_split = slow_download
    tempfile.tempdir = tmp[rank]
    os.environ.update(LOCAL_RANK=str(local_ranks[rank]), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    # Joined with time to spare (a loaded machine starts the two processes seconds apart),
    # then the group's own timeout cut to 3 s.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))
    local = download.dataset_on_this_node(
        f"gs://bucket/{os.path.basename(dataset_dir)}", ("train", "validation"),
        poll_seconds=0.05)
    complete = all(os.path.isfile(os.path.join(local, entry.path))
                   for split in ("train", "validation")
                   for entry in manifest_lib.read_manifest(local).splits[split].shards)
    with open(os.path.join(results, f"rank{rank}"), "w") as f:
        f.write(f"{local}\n{complete}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["one node", "two nodes"])
def test_ranks_wait_for_a_nodes_copy_of_a_remote_dataset_beyond_the_groups_timeout(
        dataset_dir, tmp_path, layout):
    """One node: local rank 0 copies, the other rank waits for its marker and reads the same
    directory, every file there by then (all ranks re-resolving it raced on its manifest's
    temp file). Two nodes: the second has its copy already and waits for the first's. Either
    wait outlasts the run's process group's timeout (3 s here, 30 minutes on a cluster, where
    a copy of hundreds of GB takes longer), so neither may be one of its collectives."""
    import torch.multiprocessing as mp

    from bertforge.training.data import download
    from tests.support.local_cluster import free_port

    nodes = [str(tmp_path / "node-a"), str(tmp_path / ("node-a" if layout == "one node"
                                                        else "node-b"))]
    for node in set(nodes):
        os.makedirs(node)
    (tmp_path / "results").mkdir()
    if layout == "two nodes":  # node B copied it in an earlier run
        remote = pafs.SubTreeFileSystem(os.path.dirname(dataset_dir), pafs.LocalFileSystem())
        for split in ("train", "validation"):
            download.download_split(remote, os.path.basename(dataset_dir), split,
                                    cache_dir=os.path.join(nodes[1], "bertforge-datasets"))
    local_ranks = [0, 1] if layout == "one node" else [0, 0]
    mp.spawn(_copy_on_a_node, args=(2, free_port(), dataset_dir, nodes,
                                    str(tmp_path / "results"), local_ranks), nprocs=2)
    seen = [(tmp_path / "results" / f"rank{r}").read_text().splitlines() for r in (0, 1)]
    assert [complete for _, complete in seen] == ["True", "True"]
    for rank, (path, _) in enumerate(seen):
        assert path.startswith(os.path.join(nodes[rank], "bertforge-datasets"))
        leftovers = [name for name in os.listdir(path)
                     if name.startswith(".copied-") or ".tmp" in name or ".partial" in name]
        assert leftovers == []  # this run's marker goes once every rank has read it


def test_an_empty_split_says_so_whatever_the_batch(tmp_path):
    """An empty split advised "a smaller batch ... drop_last=False serves every sample", which
    an evaluation loader already had and no batch size mends."""
    data = write_dataset(str(tmp_path / "data"), {"train": [8], "validation": [0]})
    for drop_last in (True, False):
        with pytest.raises(UserInputError, match=r"split 'validation' of .* holds no samples: "
                           r"prepare more data") as error:
            PretrainingLoader(data, "validation", batch_size=1, seed=0, drop_last=drop_last)
        assert "batch" not in str(error.value)
