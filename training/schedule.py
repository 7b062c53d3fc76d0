"""Learning-rate schedule: linear warmup, then linear or polynomial decay to zero."""

from __future__ import annotations


def lr_multiplier(
    step: int, *, warmup_steps: int, max_steps: int, decay: str = "linear", power: float = 1.0
) -> float:
    """Factor on the peak LR for optimizer step `step` (0-based).

    Warmup reaches the peak at step == warmup_steps; decay reaches 0 at step == max_steps.
    Linear decay is polynomial decay with power 1 (Google BERT uses exactly that).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay not in ("linear", "polynomial"):
        raise ValueError(f"unknown decay {decay!r}")
    exponent = 1.0 if decay == "linear" else power
    remaining = max(0, max_steps - step) / max(1, max_steps - warmup_steps)
    return remaining**exponent
