"""Packing: several instances a row, so a batch is (almost) all real tokens.

Padding is most of a BERT batch's positions at 512 tokens (>50 %, Graphcore, arXiv
2107.02027) and still a share at 128; packing puts several instances in one row, each attending
only to itself (block-diagonal attention), positions restarting per instance, NSP read at each
instance's [CLS]: the same numbers as one instance a row, less of the batch wasted.

The batch stays defined in instances: a rank's micro-batch holds `batch_size` of them, each
masked exactly as unpacked (masks are keyed by sample index); packing moves the masked rows
into packed rows. Packing a micro-batch alone leaves the gaps its own instances cannot fill, so
by default (`PackingOptions.regroup`) the loader also chooses, within each optimizer step,
which instances share a global batch and a micro-batch (`step_groups`): the step's samples
stay the same, its global batches depend on (step batch, global batch) only, so determinism,
exact resume and the same global batches for any number of ranks hold as unpacked.

The layout is first-fit decreasing on the instances' lengths (ties by their place in the
batch: deterministic), at most `max_per_row` a row: NVIDIA's and Graphcore's BERT pack at most
3 a row at 512, and a bound makes the per-row NSP tensors of fixed width. Within a row the
instances keep their batch order.

A packed batch carries, besides the Hugging Face names (`input_ids`, `token_type_ids`,
`attention_mask`, `labels` as [rows, width]):

    position_ids         [rows, width]: 0, 1, ... within each instance; 0 on padding
    cls_positions        [rows, max_per_row]: where each instance's [CLS] is; 0 for an empty slot
    next_sentence_label  [rows, max_per_row]: per instance slot; -100 (ignored) for an empty slot

`training.model` reads the instance boundaries from `position_ids` (an instance starts where its
position is 0) and the attention mask.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from bertforge.training.data.rows import padded_width
from bertforge.training.masking import IGNORE_INDEX

# NVIDIA's MLPerf BERT and Graphcore's packing paper: up to 3 sequences a row at 512 tokens.
DEFAULT_MAX_PER_ROW = 3


@dataclass(frozen=True)
class PackingOptions:
    """Several instances a row, up to `max_per_row`, in rows of the dataset's max_seq_length.

    `regroup`: choose, within each optimizer step, which instances share a global batch and a
    micro-batch so that they pack well (`step_groups`; the step's samples do not change).
    Packing a micro-batch alone leaves the gaps its own instances cannot fill: on the real
    shards at 512 tokens, 5.9 % padding at micro-batch 32 (11.7 % unpacked), 4.4 % regrouped
    within steps of 256, the packing of the whole step.
    """

    max_per_row: int = DEFAULT_MAX_PER_ROW
    regroup: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_per_row, bool) or self.max_per_row < 1:
            raise ValueError(f"max_per_row must be >= 1, got {self.max_per_row}")


def packed_max_predictions(per_instance: int, mask_prob: float, row_length: int,
                           max_per_row: int) -> int:
    """The most labelled positions a packed row can hold (a fixed-width sparse MLM head's
    slots). An instance of n tokens has min(P, max(1, round(p x n))) <= p x n + 1 labels, so a
    row of at most S tokens and K instances at most p x S + K: 19 + 3 = 22 at 128 tokens
    (P 20), 76 + 3 = 79 at 512 (P 80); not K x P (60, 240), which would run the head on ~3x the
    slots."""
    bound = int(mask_prob * row_length + 1e-6) + max_per_row
    return min(max_per_row * per_instance, bound, row_length)


@dataclass(frozen=True)
class PackLayout:
    """Where each instance of a batch goes: row, slot in the row, first token in the row."""

    row: np.ndarray  # int64[B]
    slot: np.ndarray  # int64[B], 0-based place among the row's instances
    offset: np.ndarray  # int64[B], position of the instance's [CLS] in its row
    num_rows: int
    width: int  # the fullest row rounded up to a multiple of 8


def pack_layout(lengths: np.ndarray, row_length: int, max_per_row: int) -> PackLayout:
    """Best-fit decreasing: longest instance first (ties: batch order), each into the open row
    it fills the most (the least room left that still holds it), else into a new row; a row
    closes at `max_per_row` instances. Within a row the instances keep their batch order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    row = _best_fit_rows(lengths, row_length, max_per_row)
    num, num_rows = len(lengths), int(row.max(initial=-1)) + 1
    order = np.lexsort((np.arange(num), row))  # by (row, batch index)
    sorted_rows, sorted_lengths = row[order], lengths[order]
    first = np.searchsorted(sorted_rows, sorted_rows)  # where each row's instances begin
    before = np.cumsum(sorted_lengths) - sorted_lengths  # tokens before, in the sorted order
    slot, offset = np.zeros((2, num), dtype=np.int64)
    slot[order] = np.arange(num) - first
    offset[order] = before - before[first]
    fill = np.bincount(row, weights=lengths, minlength=num_rows)
    return PackLayout(row, slot, offset, num_rows, padded_width(int(fill.max(initial=0))))


def _best_fit_rows(lengths: np.ndarray, row_length: int, max_per_row: int) -> np.ndarray:
    """The row of each instance. Open rows are kept by room left (a stack per value), so a
    placement scans room values, not rows: ~2 us an instance, 4,096 instances in ~10 ms."""
    if len(lengths) and (int(lengths.min()) < 1 or int(lengths.max()) > row_length):
        raise ValueError(f"instance lengths must be in [1, {row_length}], got "
                         f"[{int(lengths.min())}, {int(lengths.max())}]")
    open_rows: list[list[int]] = [[] for _ in range(row_length + 1)]  # by room left
    has_open = np.zeros(row_length + 1, dtype=bool)
    room, count = [], []
    row = np.zeros(len(lengths), dtype=np.int64)
    for index in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[index])
        candidates = np.flatnonzero(has_open[length:])
        if len(candidates):
            left = length + int(candidates[0])
            target = open_rows[left].pop()
            has_open[left] = bool(open_rows[left])
        else:
            target = len(room)
            room.append(row_length)
            count.append(0)
        room[target] -= length
        count[target] += 1
        row[index] = target
        if count[target] < max_per_row and room[target] > 0:
            open_rows[room[target]].append(target)
            has_open[room[target]] = True
    return row


def packing_groups(
    lengths: np.ndarray, row_length: int, max_per_row: int, group_size: int
) -> np.ndarray:
    """A partition of len(lengths) instances into groups of exactly `group_size` that pack
    well, as a permutation: positions of group 0, then group 1, ... (each in its own order).

    The instances are packed together (`pack_layout`), then whole rows go to the group that
    needs the most instances (most instances a row first); a row that fits no group's need is
    split into single instances, which fill the groups last.
    """
    num = len(lengths)
    assert num % group_size == 0, (num, group_size)
    num_groups = num // group_size
    if num_groups <= 1:
        return np.arange(num)
    row = pack_layout(lengths, row_length, max_per_row).row
    members = np.argsort(row, kind="stable")  # instances by row, each row in batch order
    rows = np.split(members, np.flatnonzero(np.diff(row[members])) + 1)
    rows.sort(key=len, reverse=True)  # stable: ties keep their row order
    need = [(-group_size, group) for group in range(num_groups)]  # a heap: most need first
    group_of = np.zeros(num, dtype=np.int64)
    left_over: list[int] = []
    for part in rows:
        most, group = heapq.heappop(need)
        if -most >= len(part):
            group_of[part] = group
            most += len(part)
        else:
            left_over.extend(part.tolist())
        heapq.heappush(need, (most, group))
    for index in sorted(left_over):
        most, group = heapq.heappop(need)
        group_of[index] = group
        heapq.heappush(need, (most + 1, group))
    return np.argsort(group_of, kind="stable")


def pack_batch(
    batch: dict[str, torch.Tensor], *, pad_id: int, row_length: int, max_per_row: int
) -> dict[str, torch.Tensor]:
    """A collated batch (one instance a row) repacked: the same tokens and labels, moved."""
    real = batch["attention_mask"].numpy().astype(bool)
    num, width_in = real.shape
    lengths = real.sum(axis=1)
    layout = pack_layout(lengths, row_length, max_per_row)
    # Token (i, p) of instance i goes to flat position row_i x width + offset_i + p.
    starts = layout.row * layout.width + layout.offset
    destination = (starts[:, None] + np.arange(width_in))[real]
    size = layout.num_rows * layout.width

    def moved(values: np.ndarray, fill: int) -> torch.Tensor:
        out = np.full(size, fill, dtype=np.int64)
        out[destination] = values[real]
        return torch.from_numpy(out.reshape(layout.num_rows, layout.width))

    positions = np.broadcast_to(np.arange(width_in), real.shape)
    cls_positions = np.zeros((layout.num_rows, max_per_row), dtype=np.int64)
    cls_positions[layout.row, layout.slot] = layout.offset
    next_sentence = np.full((layout.num_rows, max_per_row), IGNORE_INDEX, dtype=np.int64)
    next_sentence[layout.row, layout.slot] = batch["next_sentence_label"].numpy()
    return {
        "input_ids": moved(batch["input_ids"].numpy(), pad_id),
        "token_type_ids": moved(batch["token_type_ids"].numpy(), 0),
        "attention_mask": moved(np.ones(real.shape, dtype=np.int64), 0),
        "labels": moved(batch["labels"].numpy(), IGNORE_INDEX),
        "position_ids": moved(positions, 0),
        "cls_positions": torch.from_numpy(cls_positions),
        "next_sentence_label": torch.from_numpy(next_sentence),
    }


def step_groups(
    lengths: np.ndarray, row_length: int, max_per_row: int, global_batch: int, micro_batch: int
) -> np.ndarray:
    """The instances of one optimizer step regrouped, as a permutation of its positions: into
    global batches that pack well, then each global batch into micro-batches that pack well.

    Two levels, so that the global batches depend on (step batch, global batch) only: any
    number of ranks with the same global batch splits the same global batches.
    """
    by_global = packing_groups(lengths, row_length, max_per_row, global_batch)
    parts = []
    for start in range(0, len(by_global), global_batch):
        members = by_global[start : start + global_batch]
        parts.append(members[packing_groups(lengths[members], row_length, max_per_row,
                                            micro_batch)])
    return np.concatenate(parts) if parts else by_global
