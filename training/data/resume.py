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
from typing import TYPE_CHECKING, Any

from bertforge.training.data.order import DEFAULT_BUCKET_WINDOW

if TYPE_CHECKING:
    from bertforge.training.data.loader import PretrainingLoader

STATE_VERSION = 2  # 2: position in samples, step batch, bucketing


def loader_state(loader: PretrainingLoader) -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "epoch": loader.epoch,
        "samples_consumed": loader.samples_consumed,  # the position, free of the layout
        "batches_consumed": loader.batches_consumed,  # in this loader's global batches
        "epoch_finished": loader.batches_consumed == len(loader),
        "seed": loader.seed,
        "global_batch_size": loader.global_batch_size,
        "step_batch_size": loader.step_batch_size,
        "num_samples": loader.num_samples,
        "split": loader.split,
        "bucket_boundaries": _as_list(loader.bucket_boundaries),
        "bucket_window": loader.bucket_window,
        "packing_groups": _as_list(_grouping(loader)),
    }


def resume_position(loader: PretrainingLoader, state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, batches consumed) of `loader` at a saved position; refuses what cannot resume.

    A state saved at the very end of an epoch resumes at the start of the next one.
    """
    state = upgrade_state(state)
    _check_same_order(loader, state)
    epoch, samples = int(state["epoch"]), int(state["samples_consumed"])
    if not 0 <= samples <= loader.num_samples:
        raise ValueError(f"saved position {samples} is outside the epoch of {loader.num_samples}")
    if state["epoch_finished"] or samples >= len(loader) * loader.global_batch_size:
        # Nothing of the epoch left for this layout: an uninterrupted run goes on with the
        # next epoch, and a loop that iterates right after loading must not find nothing.
        epoch, samples = epoch + 1, 0
    if samples % loader.global_batch_size:
        raise ValueError(_boundary_error(loader, samples, epoch, state["global_batch_size"]))
    _check_same_grouping(loader, state, samples)
    return epoch, samples // loader.global_batch_size


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


def _check_same_order(loader: PretrainingLoader, state: dict[str, Any]) -> None:
    """Refuse a state whose position would point at other samples in this loader's order."""
    for key in ("seed", "num_samples"):
        if state[key] != getattr(loader, key):
            raise ValueError(
                f"cannot resume: the saved loader state has {key}={state[key]}, this loader "
                f"has {getattr(loader, key)} (the position would point at other samples)"
            )
    saved = _bucketing(state["bucket_boundaries"], state["bucket_window"])
    mine = _bucketing(loader.bucket_boundaries, loader.bucket_window)
    if saved != mine:
        raise ValueError(
            f"cannot resume: the saved loader state has length bucketing (boundaries, window) "
            f"{saved}, this loader {mine}: the epoch's order would differ"
        )
    if mine is not None and state["step_batch_size"] != loader.step_batch_size:
        raise ValueError(
            f"cannot resume: length bucketing cuts the order in optimizer steps of "
            f"{state['step_batch_size']} samples (saved), this loader's step is "
            f"{loader.step_batch_size} ({loader.batch_size} x {loader.world_size} ranks x "
            f"{loader.gradient_accumulation_steps} accumulation): keep micro-batch x ranks x "
            "gradient_accumulation_steps the same"
        )


def _grouping(loader: PretrainingLoader) -> tuple[int, int, int] | None:
    """What shapes the regrouping of a step's samples for packing: the global batches of a
    step depend on (max_per_row, step batch, global batch) (see `training.data.packing`)."""
    if not loader.regroups:
        return None
    return (loader.packing.max_per_row, loader.step_batch_size, loader.global_batch_size)


def _check_same_grouping(loader: PretrainingLoader, state: dict[str, Any], samples: int) -> None:
    """Regrouping reorders samples within a step only: a position at a step boundary (of
    each layout that regroups) has consumed the same samples whatever the grouping; one
    inside a step resumes only under the same grouping."""
    saved = state.get("packing_groups")
    mine = _grouping(loader)
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
    loader: PretrainingLoader, samples: int, epoch: int, saved_global_batch: int
) -> str:
    global_batch = loader.global_batch_size
    every = global_batch // math.gcd(global_batch, saved_global_batch)
    return (
        f"cannot resume after {samples} samples of epoch {epoch} with a global batch of "
        f"{global_batch} ({loader.batch_size} x {loader.world_size} ranks): a loader "
        f"resumes only at multiples of its global batch. With this layout, resume from a "
        f"state saved after a multiple of {global_batch} samples (every {every} "
        f"batches of the saving layout, whose global batch was {saved_global_batch}), or "
        f"pick batch_size x world_size dividing {samples}"
    )


def _as_list(values: Sequence[int] | None) -> list[int] | None:
    return None if values is None else list(values)


def _bucketing(boundaries: Sequence[int] | None, window: int) -> tuple | None:
    """What of the bucketing options shapes the order (the window counts only with bins)."""
    return None if boundaries is None else (tuple(boundaries), window)
