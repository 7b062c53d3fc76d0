"""training/host_gc.py: the objects alive after a run's first step are out of the cyclic
collector's reach while the run steps, and back in it when the run ends, however it ends."""

from __future__ import annotations

import gc
import weakref

import pytest

from bertforge.training.host_gc import CollectionClock, FrozenSurvivors
from bertforge.training.loop import train
from tests.training.test_loop import config


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def only_the_collections_asked_for():
    """No automatic pass in between: what a test sees collected, it collected."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_garbage_goes_and_survivors_freeze_until_the_exit(only_the_collections_asked_for):
    already_garbage = _Cycle()
    gone_before = weakref.ref(already_garbage)
    del already_garbage
    survivor = _Cycle()
    gone = weakref.ref(survivor)
    with FrozenSurvivors() as survivors:
        survivors.freeze()
        assert gone_before() is None  # garbage by then is collected, not frozen
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules, functions, classes...
        del survivor
        gc.collect()
        assert gone() is not None  # a frozen cycle waits for the unfreeze
        # Again (a log line): what became garbage since goes, what survived since freezes.
        later_garbage, later_survivors = _Cycle(), [[] for _ in range(1000)]
        gone_later = weakref.ref(later_garbage)
        del later_garbage
        survivors.freeze()
        assert gone_later() is None
        # (Frozen objects that lost their last reference meanwhile are gone from the count.)
        assert gc.get_freeze_count() > frozen + len(later_survivors) // 2
        del later_survivors
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None


def test_an_error_inside_unfreezes_too() -> None:
    with pytest.raises(RuntimeError), FrozenSurvivors() as survivors:
        survivors.freeze()
        raise RuntimeError("a stopped run")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_before_is_left_as_it_was() -> None:
    """Another run around this one, or a library, froze objects first: the run neither adds
    to that freeze nor undoes it."""
    gc.freeze()
    try:
        # Frozen objects are still freed by their reference counts (other threads' too), so
        # the count may only fall: a thousand lists more would be a freeze of the run's own,
        # a count near zero an undone one.
        before = gc.get_freeze_count()
        with FrozenSurvivors() as survivors:
            survivors_of_the_run = [[] for _ in range(1000)]
            survivors.freeze()
            assert gc.get_freeze_count() < before + len(survivors_of_the_run)
        assert gc.get_freeze_count() > before - len(survivors_of_the_run)
    finally:
        gc.unfreeze()


def test_frozen_the_collector_starts_no_full_pass_of_its_own_but_young_ones() -> None:
    """From the first freeze to the exit, allocations that start full passes otherwise (seen:
    4 in 400,000 surviving lists) start only young ones; the exit gives the thresholds back."""
    # The collector starts a full pass once the survivors of young passes exceed a quarter of
    # what the last full pass left: more than half the tracked objects, however many this
    # process holds (a suite worker holds more than a test alone).
    count = max(400_000, len(gc.get_objects()) // 2 + 1)

    def allocate() -> list[list]:
        return [[] for _ in range(count)]

    thresholds = gc.get_threshold()
    with CollectionClock() as unfrozen:
        kept = allocate()
    del kept
    assert unfrozen.full_passes(), "the allocations start no full pass here: no control"
    with FrozenSurvivors() as survivors, CollectionClock() as frozen:
        assert gc.get_threshold() == thresholds  # nothing changes before the first freeze
        survivors.freeze()
        frozen.passes.clear()  # the freeze's own collection
        kept = allocate()
    del kept
    assert frozen.passes and not frozen.full_passes()
    assert gc.get_threshold() == thresholds


def test_the_clock_counts_what_a_pass_frees(only_the_collections_asked_for):
    with CollectionClock() as clock:
        cycle = _Cycle()
        del cycle
        gc.collect(2)
    [full] = clock.full_passes()
    assert full.collected >= 1


def test_the_clock_tells_full_passes_from_young_ones(only_the_collections_asked_for):
    with CollectionClock() as clock:
        gc.collect(0)
        gc.collect(2)
    assert [one.generation for one in clock.passes] == [0, 2]
    assert len(clock.full_passes()) == 1 and clock.full_passes()[0].seconds > 0
    gc.collect(2)
    assert len(clock.passes) == 2  # the callback is gone


def test_a_training_run_steps_frozen_and_ends_unfrozen(tmp_path) -> None:
    """The real loop (tiny model, CPU): frozen from its first step on (seen at each checkpoint,
    through the loop's report), nothing frozen once it returns or fails; a resumed run, whose
    first step is no log line, too."""
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "data"), {"train": [40]}, max_seq_length=64)
    seen = []
    train(config(data, tmp_path / "run", max_steps=4, checkpoint_every=2, zero_stage=0),
          report=lambda update: seen.append(gc.get_freeze_count()))
    assert len(seen) == 2 and all(count > 1000 for count in seen)
    assert gc.get_freeze_count() == 0
    seen.clear()  # resumed to step 7, logging at 6 and 7: step 5, its first, is no log line
    train(config(data, tmp_path / "run", max_steps=7, checkpoint_every=5, log_every=3,
                 zero_stage=0), report=lambda update: seen.append(gc.get_freeze_count()))
    assert len(seen) == 2 and all(count > 1000 for count in seen)
    assert gc.get_freeze_count() == 0

    def stop(update):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config(data, tmp_path / "stopped", max_steps=4, checkpoint_every=2, zero_stage=0),
              report=stop)
    assert gc.get_freeze_count() == 0
