"""Python's cyclic garbage collector kept off the training steps.

A full (generation 2) collection walks every object the collector tracks, and a training
process holds hundreds of thousands once it has imported torch, DeepSpeed and the rest and
compiled its model (233,907 after the imports alone; a full collection of them took 97-197 ms
on a 2-core Xeon without native bf16, 2026-11-28, with a test suite running beside it: an order
of size, not a measurement). The interpreter starts one whenever its counts say so, inside
whichever step is running: on a GPU whose queue the host keeps only just ahead (97 % busy), the
pause is that step's. One timed step of 30 at 512 tokens took 423 ms where the others took
160-170 (H200, 2026-11-28), which such a pause would explain; not proven.

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


class FrozenSurvivors:
    """`with FrozenSurvivors() as survivors:` around a run's steps, `survivors.freeze()` after
    its first step and at its log lines. The exit unfreezes, also after an error or a stop."""

    def __init__(self) -> None:
        self.frozen = False
        self.frozen_by_others = False

    def freeze(self) -> None:
        """Collect what is garbage now, then freeze what survives."""
        if self.frozen_by_others:
            return
        gc.collect()  # nothing that is garbage now waits, frozen, for the run's end
        gc.freeze()
        self.frozen = True

    def __enter__(self) -> FrozenSurvivors:
        self.frozen_by_others = gc.get_freeze_count() > 0
        return self

    def __exit__(self, *exc_info) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


class CollectionClock:
    """`with CollectionClock() as clock:`: each pass of the collector meanwhile, as
    (generation, seconds) in `clock.passes` (gc.callbacks), to show where they fell."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.passes.append((info["generation"], time.perf_counter() - self._started))
            self._started = None

    def full_passes(self) -> list[float]:
        """Seconds of each full (generation 2) pass."""
        return [seconds for generation, seconds in self.passes if generation == 2]

    def __enter__(self) -> CollectionClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._callback)
