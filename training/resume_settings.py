"""The settings a resumed run keeps where its command names none.

"The same command resumes" was the whole contract: a resume typed again without the run's
flags took the defaults instead. A 30-step run of batch 16 that kept 5 checkpoints, resumed as
`bertforge train --data D --run-dir R`, trained on to 1,000 steps of batch 32 and pruned the
checkpoints it had been told to keep down to 2. So each checkpoint records the settings its
command asked for (`bertforge.json`'s `train_config`: as asked, before the device decided
precision, stage or micro-batch, so a resume on another machine decides them again), and a
resume takes every one its command does not give.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bertforge.pipelines.contract.config_fields import flag_spellings
from bertforge.training import checkpoint
from bertforge.training.config import DERIVED_FROM_MAX_STEPS, TrainConfig

RECORDED = "train_config"  # the key in a checkpoint's bertforge.json
# Where the run is and what starts it, not how it trains: never taken from the checkpoint.
# (The model: `warm_start.continued_model`; a profile window is one command's diagnostic.)
NOT_CONTINUED = ("data_dir", "run_dir", "resume", "init_from", "model", "profile_steps")


# Beside the settings: those of DERIVED_FROM_MAX_STEPS the command left to follow max_steps.
DERIVED = "derived_from_max_steps"
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def recorded_settings(cfg: TrainConfig, derived: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a checkpoint records of the command that trained it, and which of its settings
    followed max_steps (`derived`): those follow a resume's new length, where a value given
    (`--warmup-steps 300` of 3,000 steps, what the length derives anyway) is kept."""
    settings = {name: value for name, value in cfg.to_dict().items()
                if name not in NOT_CONTINUED}
    return {**settings, DERIVED: sorted(derived)}


def run_settings(run_dir: str) -> dict[str, Any]:
    """The settings the newest complete checkpoint of `run_dir` records (read once for
    `continued_settings` and `changed_settings`); {} for a fresh run or one saved before
    checkpoints recorded them."""
    if not checkpoint.committed_steps(run_dir):
        return {}
    newest = checkpoint.latest_checkpoint(run_dir)
    try:
        return checkpoint.read_metadata(newest).get(RECORDED) or {}
    except (OSError, ValueError):
        return {}  # the run's input checks say what is wrong with it


def _known(recorded: dict[str, Any]) -> dict[str, Any]:
    """The recorded settings this bertforge has a field for, less where the run is."""
    return {name: value for name, value in recorded.items()
            if name in _FIELDS and name not in NOT_CONTINUED}


def continued_settings(recorded: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The run's settings (`recorded`: `run_settings`) that `given`, the command's own, leaves
    out."""
    continued = {name: value for name, value in _known(recorded).items() if name not in given}
    # What followed the run's length follows this command's (the same length: the same
    # values), and stays derived in this run's record: continued, it would count as given.
    for name in _derived(recorded, recorded.get("max_steps")):
        continued.pop(name, None)
    return continued


def _derived(recorded: dict[str, Any], steps: int | None) -> list[str]:
    """The settings that followed the run's length; saved before checkpoints recorded them
    (2026-11-29), those equal to what the length derives (a `--warmup-steps 300` given to
    3,000 steps was taken for derived then)."""
    if DERIVED in recorded:
        return list(recorded[DERIVED])
    return [name for name, derive in DERIVED_FROM_MAX_STEPS.items()
            if steps is not None and recorded.get(name) == derive(steps)]


def changed_settings(recorded: dict[str, Any],
                     given: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{name: (the run's own value, the command's)} for the settings `given` sets otherwise
    than the run recorded them (`recorded`: `run_settings`): a resume trains on with the
    command's."""
    known = _known(recorded)
    return {name: (known[name], value) for name, value in given.items()
            if name in known and not _same(known[name], value)}


def describe(continued: dict[str, Any]) -> str:
    """`--steps 30, --batch-size 16` for the continued settings that differ from the
    defaults (the rest would be the same either way)."""
    defaults = TrainConfig(data_dir="-", run_dir="-").to_dict()
    return ", ".join(_as_typed(name, value) for name, value in continued.items()
                     if not _same(value, defaults.get(name)))


def describe_changes(changed: dict[str, tuple[Any, Any]]) -> str:
    """`--mask-prob 0.2 (the run's: 0.15), --packing (the run's: --no-packing)`."""
    return ", ".join(f"{_as_typed(name, given)} (the run's: {_shown(name, own)})"
                     for name, (own, given) in changed.items())


def _as_typed(name: str, value: Any) -> str:
    """The flag that sets `name` to `value`, as a user types it."""
    if isinstance(value, bool):
        return _shown(name, value)
    return f"{flag_spellings(_FIELDS[name])[0]} {_shown(name, value)}"


def _shown(name: str, value: Any) -> str:
    """A value as typed after its flag; a switch as the flag itself (`--no-packing`)."""
    if isinstance(value, bool):
        flag = flag_spellings(_FIELDS[name])[0]
        return flag if value else f"--no-{flag.removeprefix('--')}"
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def _same(a: Any, b: Any) -> bool:
    as_list = (list, tuple)
    return list(a) == list(b) if isinstance(a, as_list) and isinstance(b, as_list) else a == b
