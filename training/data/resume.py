"""The loader's position as a state dict: saved, upgraded from older layouts, checked, resumed.

The position counts samples of the epoch's order, not batches, so any layout resumes it whose
global batch divides it: another number of ranks, or the same optimizer step split otherwise
between micro-batches and accumulation (2 ranks x accumulation 1 -> 1 rank x 2). What must
match is what shapes the order: the seed, the number of samples and the length bucketing
(with bucketing, the step batch too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bertforge.training.data.order import DEFAULT_BUCKET_WINDOW

STATE_VERSION = 2  # 2: position in samples, step batch, bucketing


@dataclass(frozen=True)
class Layout:
    """What of a loader its position depends on (the loader's `layout`)."""

    seed: int
    split: str
    num_samples: int
    num_batches: int  # global batches per epoch (the loader's len)
    batch_size: int  # per rank
    world_size: int
    gradient_accumulation_steps: int
    bucket_boundaries: Sequence[int] | None
    bucket_window: int
    # The packing option that shapes regrouped steps; None when steps are not regrouped.
    regroup_max_per_row: int | None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def step_batch_size(self) -> int:
        return self.global_batch_size * self.gradient_accumulation_steps


def loader_state(layout: Layout, epoch: int, batches_consumed: int) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "epoch": epoch,
        # The position, free of the layout.
        "samples_consumed": min(batches_consumed * layout.global_batch_size, layout.num_samples),
        "batches_consumed": batches_consumed,  # in this loader's global batches
        "epoch_finished": batches_consumed == layout.num_batches,
        "seed": layout.seed,
        "global_batch_size": layout.global_batch_size,
        "step_batch_size": layout.step_batch_size,
        "num_samples": layout.num_samples,
        "split": layout.split,
        "bucket_boundaries": _as_list(layout.bucket_boundaries),
        "bucket_window": layout.bucket_window,
        "packing_groups": _as_list(_grouping(layout)),
    }


def resume_position(layout: Layout, state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, batches consumed) of a loader of this layout at a saved position; refuses what
    cannot resume.

    A state saved at the very end of an epoch resumes at the start of the next one.
    """
    _check_is_a_state(state)
    state = upgrade_state(state)
    _check_same_order(layout, state)
    epoch, samples = int(state["epoch"]), int(state["samples_consumed"])
    if not 0 <= samples <= layout.num_samples:
        raise ValueError(f"saved position {samples} is outside the epoch of {layout.num_samples}")
    if state["epoch_finished"] or samples >= layout.num_batches * layout.global_batch_size:
        # Nothing of the epoch left for this layout: an uninterrupted run goes on with the
        # next epoch, and a loop that iterates right after loading must not find nothing.
        epoch, samples = epoch + 1, 0
    if samples % layout.global_batch_size:
        raise ValueError(_boundary_error(layout, samples, epoch, state["global_batch_size"]))
    _check_same_grouping(layout, state, samples)
    return epoch, samples // layout.global_batch_size


# What every saved state holds, in any version.
_STATE_KEYS = ("epoch", "seed", "global_batch_size", "num_samples")


def _check_is_a_state(state: Any) -> None:
    """Anything but what `state_dict()` returned is one error saying so: {} was a KeyError of
    'seed', None an AttributeError, and an epoch of -3 was taken until the next iter()."""
    if not isinstance(state, dict):
        raise TypeError(f"a loader state is the dict state_dict() returned, got "
                        f"{type(state).__name__}")
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"not a loader state: it lacks {', '.join(missing)} (give what "
                         "state_dict() returned)")
    epoch = state["epoch"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"a loader state's epoch is an int >= 0, got {epoch!r}")


def upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """A saved state in the current layout; version 1 counted global batches only."""
    version = state.get("version", STATE_VERSION)
    if version > STATE_VERSION:
        raise ValueError(f"loader state version {version} is newer than this code")
    if version >= 2:
        return state
    batches, global_batch = int(state["batches_consumed"]), int(state["global_batch_size"])
    return {
        **state,
        "samples_consumed": min(batches * global_batch, int(state["num_samples"])),
        # Version 1 trained with drop_last and no accumulation: its epoch had N // G batches.
        "epoch_finished": batches == int(state["num_samples"]) // global_batch,
        "step_batch_size": global_batch,
        "bucket_boundaries": None,
        "bucket_window": DEFAULT_BUCKET_WINDOW,
    }


def _check_same_order(layout: Layout, state: dict[str, Any]) -> None:
    """Refuse a state whose position would point at other samples in this loader's order."""
    for key in ("seed", "num_samples"):
        if state[key] != getattr(layout, key):
            raise ValueError(
                f"cannot resume: the saved loader state has {key}={state[key]}, this loader "
                f"has {getattr(layout, key)} (the position would point at other samples)"
            )
    saved = _bucketing(state["bucket_boundaries"], state["bucket_window"])
    mine = _bucketing(layout.bucket_boundaries, layout.bucket_window)
    if saved != mine:
        raise ValueError(
            f"cannot resume: the saved loader state has length bucketing (boundaries, window) "
            f"{saved}, this loader {mine}: the epoch's order would differ"
        )
    if mine is not None and state["step_batch_size"] != layout.step_batch_size:
        raise ValueError(
            f"cannot resume: length bucketing cuts the order in optimizer steps of "
            f"{state['step_batch_size']} samples (saved), this loader's step is "
            f"{layout.step_batch_size} ({layout.batch_size} x {layout.world_size} ranks x "
            f"{layout.gradient_accumulation_steps} accumulation): keep micro-batch x ranks x "
            "gradient_accumulation_steps the same"
        )


def _grouping(layout: Layout) -> tuple[int, int, int] | None:
    """What shapes the regrouping of a step's samples for packing: the global batches of a
    step depend on (max_per_row, step batch, global batch) (see `training.data.packing`)."""
    if layout.regroup_max_per_row is None:
        return None
    return (layout.regroup_max_per_row, layout.step_batch_size, layout.global_batch_size)


def _check_same_grouping(layout: Layout, state: dict[str, Any], samples: int) -> None:
    """Regrouping reorders samples within a step only: a position at a step boundary (of
    each layout that regroups) has consumed the same samples whatever the grouping; one
    inside a step resumes only under the same grouping."""
    saved = state.get("packing_groups")
    mine = _grouping(layout)
    saved = None if saved is None else tuple(saved)
    if saved == mine:
        return
    steps = [key[1] for key in (saved, mine) if key is not None]
    if any(samples % step for step in steps):
        raise ValueError(
            f"cannot resume after {samples} samples: the saved loader regrouped steps for "
            f"packing as (max_per_row, step batch, global batch) = {saved}, this loader as "
            f"{mine}; that resumes only at a boundary of their optimizer steps ({steps} "
            "samples): keep the packing options and the batch layout"
        )


def _boundary_error(
    layout: Layout, samples: int, epoch: int, saved_global_batch: int
) -> str:
    global_batch = layout.global_batch_size
    every = global_batch // math.gcd(global_batch, saved_global_batch)
    return (
        f"cannot resume after {samples} samples of epoch {epoch} with a global batch of "
        f"{global_batch} ({layout.batch_size} x {layout.world_size} ranks): a loader "
        f"resumes only at multiples of its global batch. With this layout, resume from a "
        f"state saved after a multiple of {global_batch} samples (every {every} "
        f"batches of the saving layout, whose global batch was {saved_global_batch}), or "
        f"pick a micro-batch x ranks (--batch-size x --workers) dividing {samples}"
    )


def _as_list(values: Sequence[int] | None) -> list[int] | None:
    return None if values is None else list(values)


def _bucketing(boundaries: Sequence[int] | None, window: int) -> tuple | None:
    """What of the bucketing options shapes the order (the window counts only with bins)."""
    return None if boundaries is None else (tuple(boundaries), window)
