"""`bertforge eval`'s progress line: batches done of the total, the rate, the time so far."""

from bertforge.training.evaluate import EvalProgress


def test_a_line_per_interval_with_batches_done_of_the_total():
    lines = []
    progress = EvalProgress(total=40, every_seconds=0.0, say=lines.append)
    progress(1)
    progress(2)
    assert len(lines) == 2 and lines[1].startswith("[eval] 2/40 batches | ")
    assert "batches/s" in lines[1] and lines[1].endswith(" s")


def test_nothing_before_the_interval_has_passed():
    lines = []
    progress = EvalProgress(total=None, every_seconds=3600.0, say=lines.append)
    progress(1)
    assert lines == []
