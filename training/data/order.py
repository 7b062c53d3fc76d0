"""The order of an epoch: a permutation drawn from (seed, epoch), optionally bucketed by length.

Global batch g of an epoch is `order[g * G:(g + 1) * G]` with G = batch_size x world_size, and
rank r takes the r-th slice of it; so the order, and with it every global batch, depends on
neither the number of ranks nor the position a run resumed from.

Length bucketing reorders the permutation without breaking any of that: windows of
`window` optimizer-step batches are stable-sorted by length bin, cut back into step batches,
and those are shuffled within the window by the same (seed, epoch) Generator (`bucket_order`).
The order depends on the step batch, never on how it is split over ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bertforge.training.data.rows import padded_width

DEFAULT_BUCKET_WINDOW = 64  # step batches sorted together (see bucket_order)


@dataclass(frozen=True)
class BucketingOptions:
    """Length bucketing: batches of rows of similar length, so less padding.

    Give the bin edges (`boundaries`, e.g. (32, 64, 96)) or `num_buckets` equal-width bins up
    to the dataset's max_seq_length. `window`: optimizer-step batches sorted together; more
    means less padding and batches less mixed in length.
    """

    boundaries: tuple[int, ...] | None = None
    num_buckets: int | None = None
    window: int = DEFAULT_BUCKET_WINDOW

    def __post_init__(self) -> None:
        if self.boundaries is not None and self.num_buckets is not None:
            raise ValueError("length bucketing takes boundaries or num_buckets, not both")
        if self.boundaries is None and self.num_buckets is None:
            raise ValueError("length bucketing needs boundaries or num_buckets")
        if self.window < 1:
            raise ValueError(f"the bucketing window must be >= 1 (step batches), got {self.window}")
        if self.num_buckets is not None and self.num_buckets < 2:
            raise ValueError(f"num_buckets must be >= 2, got {self.num_buckets}")
        if self.boundaries is not None:
            object.__setattr__(self, "boundaries", _checked_edges(self.boundaries))

    def edges(self, max_seq_length: int) -> tuple[int, ...]:
        """The bin edges for a dataset of rows up to `max_seq_length` tokens."""
        if self.boundaries is not None:
            return self.boundaries
        return _checked_edges(even_bucket_boundaries(max_seq_length, self.num_buckets))


def _checked_edges(boundaries: Sequence[int]) -> tuple[int, ...]:
    edges = tuple(int(edge) for edge in boundaries)
    if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(
            f"bucket boundaries must be positive and strictly increasing, got {boundaries}"
        )
    return edges


def epoch_order(
    seed: int,
    epoch: int,
    num_samples: int,
    *,
    lengths: np.ndarray | None = None,
    boundaries: Sequence[int] | None = None,
    step_batch_size: int = 1,
    window: int = DEFAULT_BUCKET_WINDOW,
) -> np.ndarray:
    """The epoch's order of sample indices (uint32 when it fits: 4 bytes a sample).

    With `boundaries` (and the samples' `lengths`) the order is bucketed by length.
    """
    generator = np.random.default_rng([seed, epoch])
    dtype = np.uint32 if num_samples < 2**32 else np.int64
    # Shuffling arange in place draws exactly what permutation(N) draws, in any dtype.
    order = generator.permutation(np.arange(num_samples, dtype=dtype))
    if boundaries is None:
        return order
    # The same generator goes on to shuffle step batches: still (seed, epoch) only.
    return bucket_order(order, lengths, boundaries, step_batch_size, window, generator)


def bucket_bins(lengths: np.ndarray, boundaries: Sequence[int] | np.ndarray) -> np.ndarray:
    """Bin i holds lengths in (boundaries[i-1], boundaries[i]]: its rows pad to its top edge."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), lengths, side="left")


def bucket_order(
    order: np.ndarray,
    lengths: np.ndarray,
    boundaries: Sequence[int],
    step_batch_size: int,
    window: int,
    generator: np.random.Generator,
) -> np.ndarray:
    """Length bucketing of an epoch order: LDDL's length bins, applied at load time.

    The full step batches at the head of `order` go in windows of `window` step batches; each
    window is stable-sorted by length bin, cut back into step batches, and those are shuffled
    within the window by `generator` (so the epoch does not run short-to-long every window).
    The tail, fewer samples than a step batch, stays as it was: what drop_last drops is random,
    not the longest rows. Every sample keeps exactly one place, and the result depends on the
    step batch only, never on how ranks and micro-batches split it.
    """
    bucketed = order.copy()
    full = len(order) // step_batch_size * step_batch_size
    span = window * step_batch_size
    for start in range(0, full, span):  # window by window: temporaries stay O(window)
        part = order[start : min(start + span, full)]
        by_bin = part[np.argsort(bucket_bins(lengths[part], boundaries), kind="stable")]
        steps = by_bin.reshape(-1, step_batch_size)
        bucketed[start : start + len(part)] = steps[generator.permutation(len(steps))].ravel()
    return bucketed


def even_bucket_boundaries(max_seq_length: int, num_buckets: int) -> tuple[int, ...]:
    """Edges of `num_buckets` equal-width bins up to max_seq_length, each a multiple of 8.

    128 tokens in 4 bins: (32, 64, 96), so rows pad to at most 32, 64, 96 or 128.
    """
    edges = {padded_width(-(-max_seq_length * i // num_buckets)) for i in range(1, num_buckets)}
    return tuple(sorted(edge for edge in edges if edge < max_seq_length))
