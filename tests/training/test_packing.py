"""Packing in the loader: several instances a row, the same instances and masks as unpacked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bertforge.training.data import BucketingOptions, PackingOptions, PretrainingLoader
from bertforge.training.data.packing import pack_layout, packing_groups, step_groups
from bertforge.training.masking import IGNORE_INDEX
from tests.training.conftest import reference_and_resumed

PACKED_KEYS = ("input_ids", "token_type_ids", "attention_mask", "labels", "position_ids",
               "cls_positions", "next_sentence_label")
CLS_ID = 101  # the Google layout of tests.training.conftest


def instances_of(batch) -> list[tuple]:
    """Per instance, (ids, token types, labels, nsp label): from one-a-row or packed batches."""
    if "position_ids" not in batch:
        out = []
        for row in range(len(batch["input_ids"])):
            length = int(batch["attention_mask"][row].sum())
            out.append(tuple(tuple(batch[k][row, :length].tolist())
                             for k in ("input_ids", "token_type_ids", "labels"))
                       + (int(batch["next_sentence_label"][row]),))
        return out
    out = []
    for row in range(len(batch["input_ids"])):
        real = int(batch["attention_mask"][row].sum())
        starts = torch.nonzero(batch["position_ids"][row, :real] == 0).flatten().tolist()
        for slot, (begin, end) in enumerate(zip(starts, starts[1:] + [real], strict=True)):
            out.append(tuple(tuple(batch[k][row, begin:end].tolist())
                             for k in ("input_ids", "token_type_ids", "labels"))
                       + (int(batch["next_sentence_label"][row, slot]),))
    return out


def all_batches(loader):
    return list(loader)


def step_instances(batches, per):
    """Per optimizer step (`per` batches), its instances as a sorted list (layout-free)."""
    found = [instances_of(b) for b in batches]
    return [sorted(sum(found[i : i + per], [])) for i in range(0, len(found), per)]


def rank_step_instances(loaders, per=1):
    per_rank = [[instances_of(b) for b in loader] for loader in loaders]
    merged = [sum(parts, []) for parts in zip(*per_rank, strict=True)]
    return [sorted(sum(merged[i : i + per], [])) for i in range(0, len(merged), per)]


def padding_share(batches) -> float:
    positions = sum(b["attention_mask"].numel() for b in batches)
    return 1 - sum(int(b["attention_mask"].sum()) for b in batches) / positions


# -- the layout ---------------------------------------------------------------------------


def test_best_fit_decreasing_layout():
    lengths = np.array([60, 10, 30, 64, 20, 5, 33])
    layout = pack_layout(lengths, 64, 3)
    # 64 alone; 60 alone (no instance of <= 4); 33 + 30; 20 + 10 + 5 (the slots full at 3).
    rows = [sorted(np.flatnonzero(layout.row == r).tolist()) for r in range(layout.num_rows)]
    assert sorted(rows) == sorted([[3], [0], [2, 6], [1, 4, 5]])
    assert layout.width == 64
    for r, members in enumerate(rows):
        # batch order within a row, back to back from position 0
        assert layout.slot[members].tolist() == list(range(len(members)))
        ends = np.cumsum(lengths[members])
        assert layout.offset[members].tolist() == [0, *ends[:-1].tolist()]
        assert ends[-1] <= 64, r
    empty = pack_layout(np.zeros(0, dtype=np.int64), 64, 3)
    assert (empty.num_rows, empty.width) == (0, 8)
    with pytest.raises(ValueError, match="lengths must be in"):
        pack_layout(np.array([65]), 64, 3)


@pytest.mark.parametrize("max_per_row", [1, 2, 3, 5])
def test_layout_respects_the_row_and_the_slots(max_per_row):
    lengths = np.random.default_rng(max_per_row).integers(1, 129, 300)
    layout = pack_layout(lengths, 128, max_per_row)
    assert np.bincount(layout.row).max() <= max_per_row
    fill = np.bincount(layout.row, weights=lengths)
    assert fill.max() <= 128 and layout.width == 128
    assert np.array_equal(pack_layout(lengths, 128, max_per_row).row, layout.row)  # determinism
    if max_per_row == 1:
        assert layout.num_rows == 300
    else:
        assert layout.num_rows < 0.75 * 300


def test_packing_groups_are_a_partition_of_equal_size():
    lengths = np.random.default_rng(0).integers(1, 65, 96)
    groups = packing_groups(lengths, 64, 3, 16)
    assert sorted(groups.tolist()) == list(range(96))
    # Grouped, each group packs about as well as the whole: few rows more than the whole's.
    whole = pack_layout(lengths, 64, 3).num_rows
    parts = sum(pack_layout(lengths[groups[i : i + 16]], 64, 3).num_rows for i in range(0, 96, 16))
    random_parts = sum(pack_layout(lengths[i : i + 16], 64, 3).num_rows for i in range(0, 96, 16))
    assert parts <= whole + 2 and parts <= random_parts
    assert packing_groups(lengths, 64, 3, 96).tolist() == list(range(96))  # one group: as is
    by_step = step_groups(lengths, 64, 3, 48, 16)
    assert sorted(by_step.tolist()) == list(range(96))


# -- packed batches -------------------------------------------------------------------------


def test_a_packed_batch_holds_the_same_instances_and_masks(dataset_dir):
    plain = PretrainingLoader(dataset_dir, batch_size=16, seed=1)
    packed = PretrainingLoader(dataset_dir, batch_size=16, seed=1,
                               packing=PackingOptions(regroup=False))
    for one_a_row, batch in zip(plain, packed, strict=True):
        assert set(batch) == set(PACKED_KEYS)
        assert all(t.dtype == torch.int64 for t in batch.values())
        assert sorted(instances_of(batch)) == sorted(instances_of(one_a_row))
        assert len(batch["input_ids"]) < len(one_a_row["input_ids"])
        assert batch["input_ids"].shape[1] % 8 == 0
        assert batch["input_ids"].shape[1] <= 64  # rows of max_seq_length
        real = batch["attention_mask"].bool()
        assert int(real.sum()) == int(one_a_row["attention_mask"].sum())
        assert (batch["input_ids"][~real] == 0).all()
        assert (batch["labels"][~real] == IGNORE_INDEX).all()
        assert (batch["position_ids"][~real] == 0).all()
        # Every slot with a label points at a [CLS]; the others are empty (-100).
        used = batch["next_sentence_label"] != IGNORE_INDEX
        cls = batch["input_ids"].gather(1, batch["cls_positions"])
        assert (cls[used] == CLS_ID).all()
        assert int(used.sum()) == 16 and (batch["cls_positions"][~used] == 0).all()
        assert int((batch["input_ids"] == CLS_ID).sum()) == 16
        assert (used.sum(1) >= 1).all() and batch["cls_positions"].shape[1] == 3


def test_packing_saves_padding(dataset_dir):
    def share(**options):
        return padding_share(all_batches(PretrainingLoader(dataset_dir, batch_size=16, seed=0,
                                                           **options)))

    plain = share()
    packed = share(packing=PackingOptions(regroup=False))
    regrouped = share(packing=PackingOptions(), gradient_accumulation_steps=2)
    # 70 rows of 8..61 tokens in rows of 64: 46 % padding, 14 % packed, 7 % regrouped in steps
    # of 32.
    assert packed < 0.4 * plain and regrouped < 0.7 * packed, (plain, packed, regrouped)


def test_an_empty_rank_batch_packs_to_no_rows(dataset_dir):
    # 70 = 4 x 16 + 6 with drop_last off on 8 ranks of 2: the last global batch of 6 leaves
    # ranks 6 and 7 without rows.
    loader = PretrainingLoader(dataset_dir, batch_size=2, seed=0, rank=7, world_size=8,
                               drop_last=False, packing=PackingOptions())
    last = all_batches(loader)[-1]
    assert last["input_ids"].shape == (0, 8) and last["cls_positions"].shape == (0, 3)


def test_packing_options_are_checked(dataset_dir):
    for value in (0, -1, True):
        with pytest.raises(ValueError, match="max_per_row"):
            PackingOptions(max_per_row=value)
    with pytest.raises(ValueError, match="do not combine"):
        PretrainingLoader(dataset_dir, batch_size=4, seed=0, packing=PackingOptions(),
                          bucketing=BucketingOptions(num_buckets=4))


# -- order, determinism, world size, resume ----------------------------------------------------


def test_without_regrouping_a_rank_gets_its_unpacked_instances(dataset_dir):
    def layout(world_size, packing):
        return [
            PretrainingLoader(dataset_dir, batch_size=8 // world_size, seed=2, rank=r,
                              world_size=world_size, packing=packing)
            for r in range(world_size)
        ]

    for world_size in (1, 2):
        plain = [[sorted(instances_of(b)) for b in loader] for loader in layout(world_size, None)]
        packed = layout(world_size, PackingOptions(regroup=False))
        assert [[sorted(instances_of(b)) for b in loader] for loader in packed] == plain


@pytest.mark.parametrize("regroup", [False, True])
def test_packed_batches_are_deterministic(dataset_dir, regroup):
    def batches(prefetch):
        return all_batches(PretrainingLoader(
            dataset_dir, batch_size=8, seed=3, prefetch=prefetch, gradient_accumulation_steps=2,
            packing=PackingOptions(regroup=regroup)))

    first, again = batches(2), batches(0)
    assert len(first) == len(again) == 8
    for a, b in zip(first, again, strict=True):
        for key in PACKED_KEYS:
            assert torch.equal(a[key], b[key]), key


def test_regrouping_keeps_each_steps_samples(dataset_dir):
    plain = PretrainingLoader(dataset_dir, batch_size=4, seed=4, gradient_accumulation_steps=4)
    regrouped = PretrainingLoader(dataset_dir, batch_size=4, seed=4, gradient_accumulation_steps=4,
                                  packing=PackingOptions())
    plain_batches, regrouped_batches = all_batches(plain), all_batches(regrouped)
    assert step_instances(regrouped_batches, 4) == step_instances(plain_batches, 4)
    # ... but not in the same micro-batches (else regrouping would do nothing here).
    assert step_instances(regrouped_batches, 1) != step_instances(plain_batches, 1)
    assert padding_share(regrouped_batches) < padding_share(plain_batches)


def test_regrouping_keeps_global_batches_for_any_world_size(dataset_dir):
    """Same global batch (8) and step (16) on 1, 2, 4 ranks: the same global batches."""

    def layout(world_size):
        return [
            PretrainingLoader(dataset_dir, batch_size=8 // world_size, seed=6, rank=r,
                              world_size=world_size, gradient_accumulation_steps=2,
                              packing=PackingOptions())
            for r in range(world_size)
        ]

    steps = [rank_step_instances(layout(w)) for w in (1, 2, 4)]
    assert steps[0] == steps[1] == steps[2]
    assert len(steps[0]) == 70 // 16 * 2


@pytest.mark.parametrize("regroup", [False, True])
def test_packed_loader_resumes_exactly(dataset_dir, regroup):
    options = dict(batch_size=4, seed=5, prefetch=3, gradient_accumulation_steps=2,
                   packing=PackingOptions(regroup=regroup))
    # After 5 batches: inside an optimizer step, where the same grouping resumes too.
    want, resumed = reference_and_resumed(dataset_dir, options, epoch=2, num_batches=5)
    rest = all_batches(resumed)
    assert len(rest) == len(want) - 5
    for a, b in zip(rest, want[5:], strict=True):
        for key in PACKED_KEYS:
            assert torch.equal(a[key], b[key]), key


def test_regrouped_resume_across_layouts_at_step_boundaries(dataset_dir):
    """2 ranks x 4 x accumulation 2 -> 1 rank x 4 x accumulation 4: another grouping, so
    only a position at a boundary of both steps resumes; there the samples continue."""

    def two_ranks():
        return [PretrainingLoader(dataset_dir, batch_size=4, seed=7, rank=r, world_size=2,
                                  gradient_accumulation_steps=2, packing=PackingOptions())
                for r in range(2)]

    def one_rank():
        return PretrainingLoader(dataset_dir, batch_size=4, seed=7, gradient_accumulation_steps=4,
                                 packing=PackingOptions())

    want = rank_step_instances(two_ranks(), per=2)  # steps of 16
    for consumed, resumes in ((1, False), (2, True)):  # global batches of 8 handed out
        saver = two_ranks()
        for loader in saver:
            for _, _batch in zip(range(consumed), loader, strict=False):
                pass
        resumed = one_rank()
        if not resumes:
            with pytest.raises(ValueError, match="regrouped steps for packing"):
                resumed.load_state_dict(saver[0].state_dict())
            continue
        resumed.load_state_dict(saver[0].state_dict())
        assert step_instances(all_batches(resumed), 4) == want[1:]
    # Unpacked -> packed (and back) at a step boundary: the same samples continue.
    plain = PretrainingLoader(dataset_dir, batch_size=4, seed=7, gradient_accumulation_steps=4)
    for _, _batch in zip(range(4), plain, strict=False):
        pass
    resumed = one_rank()
    resumed.load_state_dict(plain.state_dict())
    assert step_instances(all_batches(resumed), 4) == want[1:]
