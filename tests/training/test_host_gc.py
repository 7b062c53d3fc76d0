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


def test_a_full_collection_skips_the_frozen_and_the_exit_gives_them_back() -> None:
    gc.disable()  # only the collections asked for: none by chance in between
    already_garbage = _Cycle()
    gone_before = weakref.ref(already_garbage)
    del already_garbage
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    with FrozenSurvivors() as survivors:
        survivors.freeze_once()
        gc.enable()
        assert gone_before() is None  # garbage by then is collected, not frozen
        survivors.freeze_once()  # a second call changes nothing
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules, functions, classes...
        del garbage
        gc.collect()
        assert gone() is not None  # a frozen cycle waits for the unfreeze
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None


def test_an_error_inside_unfreezes_too() -> None:
    with pytest.raises(RuntimeError), FrozenSurvivors() as survivors:
        survivors.freeze_once()
        raise RuntimeError("a stopped run")
    assert gc.get_freeze_count() == 0


def test_the_clock_tells_full_passes_from_young_ones() -> None:
    gc.disable()  # no automatic pass between the two asked for
    try:
        with CollectionClock() as clock:
            gc.collect(0)
            gc.collect(2)
    finally:
        gc.enable()
    assert [generation for generation, _ in clock.passes] == [0, 2]
    assert len(clock.full_passes()) == 1 and clock.full_passes()[0] > 0
    gc.collect(2)
    assert len(clock.passes) == 2  # the callback is gone


def test_a_training_run_steps_frozen_and_ends_unfrozen(tmp_path) -> None:
    """The real loop (tiny model, CPU): frozen from its first step on (seen at each checkpoint,
    through the loop's report), nothing frozen once it returns or fails."""
    from tests.training.conftest import write_dataset

    data = write_dataset(str(tmp_path / "data"), {"train": [40]}, max_seq_length=64)
    seen = []
    train(config(data, tmp_path / "run", max_steps=4, checkpoint_every=2, zero_stage=0),
          report=lambda update: seen.append(gc.get_freeze_count()))
    assert len(seen) == 2 and all(count > 1000 for count in seen)
    assert gc.get_freeze_count() == 0

    def stop(update):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config(data, tmp_path / "stopped", max_steps=4, checkpoint_every=2, zero_stage=0),
              report=stop)
    assert gc.get_freeze_count() == 0
