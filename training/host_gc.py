"""Python's cyclic garbage collector kept off the training steps.

A full (generation 2) collection walks every object the collector tracks, and a training
process holds hundreds of thousands once it has imported torch, DeepSpeed and the rest and
compiled its model (233,907 after the imports alone; a full collection of them took 100-200 ms
on a 2-core Xeon, 2026-11-28). The interpreter starts one whenever its counts say so, inside
whichever step is running: on a GPU whose queue the host keeps only just ahead (97 % busy), the
pause is that step's. One timed step of 30 at 512 tokens took 423 ms where the others took
160-170 (H200, 2026-11-28), which such a pause would explain; not proven.

`gc.freeze()` moves every object tracked at that moment out of the collector's reach: later
collections walk only what was created since. So once a run's first step has compiled, one
full collection frees what is garbage by then (a cycle left by building the engine or loading
a checkpoint may hold device memory), and what survives is frozen; it is unfrozen when the run
ends, so that the run's own cyclic garbage (an engine and its optimizer's references back to
it, say) is collected then, as it would have been. Frozen objects are still freed as soon as
nothing refers to them; a cycle among them waits for the unfreeze.
"""

from __future__ import annotations

import gc
import time


class FrozenSurvivors:
    """`with FrozenSurvivors() as survivors:` around a run's steps, `survivors.freeze_once()`
    after its first step (and any later call is free). The exit unfreezes, also after an
    error or a stop."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze_once(self) -> None:
        if not self.frozen:
            gc.collect()  # nothing that is garbage now waits, frozen, for the run's end
            gc.freeze()
            self.frozen = True

    def __enter__(self) -> FrozenSurvivors:
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
