"""Python's cyclic garbage collector kept off the training steps.

A full (generation 2) collection walks every object the collector tracks, and a training
process holds hundreds of thousands once it has imported torch, DeepSpeed and the rest and
compiled its model (233,907 after the imports alone; a full collection of them took 97-197 ms
on a 2-core Xeon without native bf16, 2026-11-28, with a test suite running beside it: an order
of size, not a measurement). The interpreter starts one whenever its counts say so, inside
whichever step is running: on a GPU whose queue the host keeps only just ahead (97 % busy), the
pause is that step's. One timed step of 30 at 512 tokens took 423 ms where the others took
160-170 (H200, 2026-11-28), which such a pause would explain; with the freeze below, a full
pass of 385 ms still fell inside one step of 30 there, so from the first freeze on the
collector starts none of its own (`FrozenSurvivors`).

`gc.freeze()` moves every object tracked at that moment out of the collector's reach: later
collections walk only what was created since. So once a run's first step has compiled, one
full collection frees what is garbage by then (a cycle left by building the engine or loading
a checkpoint may hold device memory), and what survives is frozen; the loop does the same at
each log line (the host waits for the device there anyway), which freezes what the steps since
left alive (a recompile's graphs) and walks only those. When the run ends everything is
unfrozen, so that its own cyclic garbage (an engine and its optimizer's references back to it,
say) goes at the next full collection, as it would have. Frozen objects are still freed as soon
as nothing refers to them; a cycle among them waits for the unfreeze.

`gc.unfreeze()` is process-wide: where something had frozen objects before a run (another
run around this one, or a library for its own reasons), the run freezes nothing and unfreezes
nothing, and leaves that freeze as it found it.
"""

from __future__ import annotations

import gc
import time
from typing import NamedTuple

# The third threshold as high as it goes: the collector's own full passes never come (each
# needs this many young passes first), while its young ones go on as before.
NO_AUTOMATIC_FULL_PASS = 2**31 - 1


class FrozenSurvivors:
    """`with FrozenSurvivors() as survivors:` around a run's steps, `survivors.freeze()` after
    its first step and at its log lines. The exit unfreezes, also after an error or a stop.

    From the first freeze to the exit the collector starts no full pass of its own: freezing
    empties the oldest generation, so such a pass walks only what the steps have left since,
    but one still fell inside a timed step at 512 tokens and took 385 ms (H200, 2026-11-28,
    one of 30; what it spent the time on is not known). The freezes at the log lines are
    the full passes instead, where the host waits anyway; the young passes, which free the
    steps' own short cycles, go on as before."""

    def __init__(self) -> None:
        self.frozen = False
        self.frozen_by_others = False
        self._thresholds: tuple[int, int, int] | None = None

    def freeze(self) -> None:
        """Collect what is garbage now, then freeze what survives."""
        if self.frozen_by_others:
            return
        gc.collect()  # nothing that is garbage now waits, frozen, for the run's end
        gc.freeze()
        self.frozen = True
        if self._thresholds is None:
            self._thresholds = gc.get_threshold()
            young, middle, _ = self._thresholds
            gc.set_threshold(young, middle, NO_AUTOMATIC_FULL_PASS)

    def __enter__(self) -> FrozenSurvivors:
        self.frozen_by_others = gc.get_freeze_count() > 0
        return self

    def __exit__(self, *exc_info) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None


class CollectorPass(NamedTuple):
    generation: int
    seconds: float
    collected: int  # objects it found unreachable and freed


class CollectionClock:
    """`with CollectionClock() as clock:`: each pass of the collector meanwhile, a
    CollectorPass in `clock.passes` (gc.callbacks), to show where they fell and whether their
    time went to freeing what they found."""

    def __init__(self) -> None:
        self.passes: list[CollectorPass] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.passes.append(CollectorPass(info["generation"],
                                             time.perf_counter() - self._started,
                                             info["collected"]))
            self._started = None

    def full_passes(self) -> list[CollectorPass]:
        """The full (generation 2) passes."""
        return [one for one in self.passes if one.generation == 2]

    def __enter__(self) -> CollectionClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._callback)
