"""The pretraining loader: one split of a prepared dataset, as masked padded batches for a rank.

Order and masks are functions of (seed, epoch, global sample index) only (DESIGN.md,
"Determinism"): the sequence of global batches is the same for any number of ranks with the
same global batch, and the loader's position, counted in samples of the epoch, resumes
exactly, even on another number of ranks, and even with another global batch when gradient
accumulation keeps the samples per optimizer step (micro x accumulation x world) the same.

Memory stays flat in the dataset size: shards are memory-mapped (a row is one seek away) and a
batch gathers only its own rows; the O(N) structures are the epoch's order, 4 bytes a sample,
and with bucketing the row lengths, 2 bytes a sample.

This module wires the parts: `split` (open and check), `order` (permutation, bucketing),
`collate` (masking), `prefetch` (the background thread) and `resume` (the position).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from bertforge.training.data.collate import MaskingOptions, PretrainingCollator
from bertforge.training.data.order import DEFAULT_BUCKET_WINDOW, BucketingOptions, epoch_order
from bertforge.training.data.packing import (
    PackingOptions,
    pack_batch,
    packed_max_predictions,
    step_groups,
)
from bertforge.training.data.prefetch import BatchIterator
from bertforge.training.data.resume import Layout, loader_state, resume_position
from bertforge.training.data.split import ReadOptions, open_split
from bertforge.training.dataset_facts import DatasetFacts
from bertforge.training.errors import UserInputError
from bertforge.training.masking import MaskingVocab


class PretrainingLoader:
    """Batches of one split for one rank, resumable to the exact batch.

    Args:
        data_dir: a prepared dataset: a local path, or a `pyarrow.fs` URI (`gs://...`), which is
            copied once to `read.cache_dir` and memory-mapped from there.
        split: "train" or "validation".
        batch_size: per rank (the micro-batch); the global batch is `batch_size x world_size`.
        seed: order and masks derive from it (with the epoch and sample index).
        rank, world_size: this worker's slice of every global batch.
        gradient_accumulation_steps: loader batches the training loop takes per optimizer step.
            The step batch (batch_size x world_size x accumulation) is the unit of the epoch's
            end and of bucketing, so layouts with the same step batch see the same samples.
        drop_last: end the epoch at the last full optimizer step (the default, and what
            training wants: every step sees the same number of samples). With False every
            sample is served, the partial last global batch split as evenly as the ranks allow;
            a rank may then get a batch of zero rows.
        prefetch: batches prepared ahead by a background thread; 0 prepares them inline.
        masking: masking rules; max_predictions None takes the dataset's default.
        bucketing: length bucketing (batches of rows of similar length); None turns it off.
        read: checks on open and where a remote dataset comes from (see `ReadOptions`): by
            default every shard's sha256 is verified in the background. Every row read is
            validated either way (`training.data.integrity`).
        packing: several instances a row (see `training.data.packing`); None: one a row. A
            batch stays `batch_size` instances, each masked as unpacked. With
            `packing.regroup` the instances of each optimizer step are regrouped into global
            and micro-batches that pack well (the step's samples unchanged); without, a
            micro-batch holds the instances it holds unpacked, only laid out otherwise.

    Iterating yields the batches of the current epoch from the current position and stops at
    the end of the epoch; `set_epoch` moves to another (and ends the live iterator). One
    iterator at a time: a new `iter()` takes over the position, and an unfinished one before
    it raises if used again. `state_dict()` counts the batches handed to the consumer (not
    those prefetched), so a checkpoint taken mid-epoch resumes exactly.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str = "train",
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        gradient_accumulation_steps: int = 1,
        drop_last: bool = True,
        prefetch: int = 2,
        masking: MaskingOptions | None = None,
        bucketing: BucketingOptions | None = None,
        read: ReadOptions | None = None,
        packing: PackingOptions | None = None,
    ):
        _check_layout(batch_size, rank, world_size, gradient_accumulation_steps, prefetch, seed)
        if not isinstance(drop_last, bool):  # "no" was taken as True
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        data_dir = os.fspath(data_dir)  # a pathlib.Path too (it failed inside a string test)
        opened = open_split(data_dir, split, read or ReadOptions())
        self.manifest, self._rows = opened.manifest, opened.rows
        self._rules, self._checksums = opened.rules, opened.checksums
        self.facts = DatasetFacts.from_manifest(opened.manifest, data_dir)
        self.max_seq_length = self.facts.max_seq_length
        self.split = split
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        # 32 micro x 8 ranks x 4 accumulation = 1,024 samples an optimizer step.
        self.step_batch_size = self.global_batch_size * gradient_accumulation_steps
        self.seed, self.drop_last, self.prefetch = seed, drop_last, prefetch
        self.pad_id = opened.vocab_tokens.index("[PAD]")
        self.packing = packing
        if packing is not None and bucketing is not None:
            raise ValueError("packing and length bucketing do not combine: bucketing puts rows "
                             "of one length together, packing wants long and short rows mixed")
        self.bucket_boundaries = None if bucketing is None else bucketing.edges(self.max_seq_length)
        self.bucket_window = DEFAULT_BUCKET_WINDOW if bucketing is None else bucketing.window
        self.collator = PretrainingCollator(
            MaskingVocab.from_tokens(opened.vocab_tokens),
            (masking or MaskingOptions()).for_dataset(self.facts),
            seed=seed,
        )
        if self.num_samples == 0:  # no batch size mends it (what the message below says)
            raise UserInputError(f"split {split!r} of {data_dir} holds no samples: prepare "
                                 "more data (a larger corpus, or --validation_fraction)")
        if len(self) == 0:  # only with drop_last: a training loader
            raise UserInputError(
                f"split {split!r} of {data_dir} has {self.num_samples} samples, fewer than one "
                f"optimizer step ({batch_size} micro x {world_size} ranks x "
                f"{gradient_accumulation_steps} accumulation = {self.step_batch_size}): give a "
                "smaller batch (batch_size; train's --batch-size or --global-batch-size), or "
                "prepare more data; drop_last=False serves every sample (what eval does)"
            )
        # Read once, before any prefetch thread: the bins or groups of every epoch need them.
        needs_lengths = self.bucket_boundaries is not None or self.regroups
        self._lengths = self._rows.row_lengths() if needs_lengths else None
        self._step_cache: tuple[np.ndarray, int, np.ndarray] | None = None
        self._epoch, self._batches_consumed = 0, 0
        self._live: weakref.ref[BatchIterator] | None = None

    # -- size and position ----------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self._rows.num_rows

    @property
    def vocab_size(self) -> int:
        return self.collator.vocab.vocab_size

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        return self._batches_consumed

    @property
    def samples_consumed(self) -> int:
        """Samples of the epoch's order handed out so far, over all ranks: the position."""
        return min(self._batches_consumed * self.global_batch_size, self.num_samples)

    def __len__(self) -> int:
        """Global batches (= this rank's batches) per epoch.

        With drop_last the epoch stops after its last full optimizer step: no step straddles
        two epochs, and every layout of the same step batch drops the same N mod step samples.
        """
        if self.drop_last:
            return self.num_samples // self.step_batch_size * self.gradient_accumulation_steps
        return -(-self.num_samples // self.global_batch_size)

    @property
    def regroups(self) -> bool:
        """Whether each optimizer step's instances are regrouped for packing."""
        return self.packing is not None and self.packing.regroup

    @property
    def max_predictions_per_row(self) -> int:
        """The most labelled positions a row of this loader's batches can hold: what a model's
        fixed-width sparse MLM head needs (`BertForPreTraining.max_predictions`).

        One instance a row: max_predictions (P); packed rows: `packed_max_predictions`.
        """
        per_instance = self.collator.masking.max_predictions
        if self.packing is None:
            return per_instance
        return packed_max_predictions(per_instance, self.collator.masking.mask_prob,
                                      self.max_seq_length, self.packing.max_per_row)

    def wait_for_checksums(self) -> None:
        """Block until every shard of the split is hashed; raise naming a file that does not
        match the manifest. The loop calls it before committing a checkpoint."""
        if self._checksums is not None:
            self._checksums.wait()

    def sample_lengths(self) -> np.ndarray:
        """Tokens of every sample of the split, by global index (from the shard offsets)."""
        if self._lengths is None:
            self._lengths = self._rows.row_lengths()
        return self._lengths

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch` at its first batch; the current epoch keeps its position.

        So a training loop may call `set_epoch(e)` blindly after `load_state_dict`.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
            raise TypeError(f"epoch must be an int, got {epoch!r}")  # 1.5 failed at iter()
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._close_live()
            self._epoch, self._batches_consumed = epoch, 0

    @property
    def layout(self) -> Layout:
        """What the position depends on: a saved position resumes under another layout only
        where `training.data.resume` allows."""
        return Layout(
            seed=self.seed, split=self.split, num_samples=self.num_samples,
            num_batches=len(self), batch_size=self.batch_size, world_size=self.world_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            bucket_boundaries=self.bucket_boundaries, bucket_window=self.bucket_window,
            regroup_max_per_row=self.packing.max_per_row if self.regroups else None,
        )

    def state_dict(self) -> dict[str, Any]:
        return loader_state(self.layout, self._epoch, self._batches_consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position (see `training.data.resume` for what may differ)."""
        epoch, batches_consumed = resume_position(self.layout, state)
        self._close_live()
        self._epoch, self._batches_consumed = epoch, batches_consumed

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # One live iterator at a time: the loader has one position. The one it replaces raises
        # if used again, rather than end its epoch early without a word.
        self._close_live(
            replaced_why="a newer iter() of this PretrainingLoader took over its position: one "
            "iterator at a time (go on with the newer one; a second loader reads on its own)")
        epoch, order = self._epoch, self.epoch_order(self._epoch)
        iterator = BatchIterator(
            functools.partial(self.make_batch, order, epoch),
            start=self._batches_consumed,
            end=len(self),
            prefetch=self.prefetch,
            handed_out=functools.partial(self._advance, epoch),
        )
        self._live = weakref.ref(iterator)
        return iterator

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's order of sample indices (see `training.data.order`)."""
        if self.bucket_boundaries is None:
            return epoch_order(self.seed, epoch, self.num_samples)
        return epoch_order(
            self.seed,
            epoch,
            self.num_samples,
            lengths=self.sample_lengths(),
            boundaries=self.bucket_boundaries,
            step_batch_size=self.step_batch_size,
            window=self.bucket_window,
        )

    def rank_indices(self, order: np.ndarray, global_batch: int) -> np.ndarray:
        """This rank's sample indices in global batch `global_batch` of an epoch order."""
        start = global_batch * self.global_batch_size
        members = order[start : start + self.global_batch_size].astype(np.int64)
        if len(members) < self.global_batch_size:
            return np.array_split(members, self.world_size)[self.rank]  # the partial last batch
        if self.regroups:
            members = self._regrouped(order, global_batch)
        return members[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def _regrouped(self, order: np.ndarray, global_batch: int) -> np.ndarray:
        """Global batch `global_batch` after its optimizer step's regrouping for packing (a
        step cut short by the epoch's end stays as it is). Cached per step: each of its
        `gradient_accumulation_steps` global batches needs the same regrouping."""
        step, within = divmod(global_batch, self.gradient_accumulation_steps)
        start = step * self.step_batch_size
        members = order[start : start + self.step_batch_size].astype(np.int64)
        if len(members) == self.step_batch_size:
            cached = self._step_cache  # one read: the prefetch thread may replace it
            if cached is not None and cached[0] is order and cached[1] == step:
                members = cached[2]
            else:
                members = members[step_groups(
                    self.sample_lengths()[members].astype(np.int64), self.max_seq_length,
                    self.packing.max_per_row, self.global_batch_size, self.batch_size,
                )]
                self._step_cache = (order, step, members)
        first = within * self.global_batch_size
        return members[first : first + self.global_batch_size]

    def make_batch(self, order: np.ndarray, epoch: int, global_batch: int) -> dict[str, Any]:
        """Batch `global_batch` of an epoch, for this rank: gather, pad, mask (and pack)."""
        if self._checksums is not None:
            self._checksums.raise_if_failed()  # a shard's hash came back wrong meanwhile
        rows = self._rows.gather(self.rank_indices(order, global_batch), self.pad_id, self._rules)
        batch = self.collator(rows, epoch)
        if self.packing is None:
            return batch
        return pack_batch(batch, pad_id=self.pad_id, row_length=self.max_seq_length,
                          max_per_row=self.packing.max_per_row)

    def _close_live(self, replaced_why: str | None = None) -> None:
        """End the live iterator; with `replaced_why`, an unfinished one raises it if used."""
        live = self._live() if self._live is not None else None
        if live is not None and replaced_why:
            live.replaced(replaced_why)
        elif live is not None:
            live.close()
        self._live = None

    def _advance(self, epoch: int, batches_consumed: int) -> None:
        assert epoch == self._epoch, "a closed iterator must not advance the loader"
        self._batches_consumed = batches_consumed


def _check_layout(
    batch_size: int, rank: int, world_size: int, accumulation: int, prefetch: int, seed: int
) -> None:
    given = {"batch_size": batch_size, "rank": rank, "world_size": world_size,
             "gradient_accumulation_steps": accumulation, "prefetch": prefetch, "seed": seed}
    for name, value in given.items():  # None or 1.5 failed later, inside numpy or a comparison
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
    if accumulation < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {accumulation}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
