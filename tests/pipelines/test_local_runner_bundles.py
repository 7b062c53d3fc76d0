"""The local runner's bounded bundles: what a worker is sent at once, and that nothing is lost."""

from __future__ import annotations

import os
import time

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner.execution import ListBuffer
from apache_beam.testing.util import assert_that, equal_to

from bertforge.pipelines.local.runner import WORKER_MALLOC_ENV, LocalRunner, numbered_bundles

MAX_BUNDLE_BYTES = 64 << 10
NUM_KEYS, VALUES_PER_KEY, VALUE_BYTES = 400, 4, 1000  # 1.6 MB: Beam would send 2 bundles


def _list_buffer(*chunks: bytes) -> ListBuffer:
    buffer = ListBuffer(coder_impl=None)
    for chunk in chunks:
        buffer.append(chunk)
    return buffer


def _bundles(inputs, max_bytes):
    return [(index, bundle) for index, bundle, _ in numbered_bundles(inputs, max_bytes)]


def test_bundles_keep_parts_whole_in_order_within_the_bound():
    bundles = _bundles({"in": _list_buffer(b"aaa", b"bbb", b"c", b"cc", b"ddd", b"eee")}, 6)
    assert [(i, b"".join(b["in"])) for i, b in bundles] == [
        (0, b"aaabbb"), (1, b"cccddd"), (2, b"eee")]


def test_an_oversized_part_is_a_bundle_of_its_own():
    bundles = _bundles({"in": _list_buffer(b"x", b"y" * 10, b"z")}, 4)
    assert [b["in"] for _, b in bundles] == [[b"x"], [b"y" * 10], [b"z"]]


def test_an_empty_stage_still_runs_one_empty_bundle():
    assert _bundles({"in": _list_buffer()}, 4) == [(0, {"in": []})]
    assert _bundles({}, 4) == [(0, {})]


def test_inputs_are_taken_one_after_the_other_in_name_order():
    inputs = {"right": _list_buffer(b"11", b"22", b"33"), "left": _list_buffer(b"aa", b"bb")}
    assert [b for _, b in _bundles(inputs, 4)] == [
        {"left": [b"aa", b"bb"], "right": []},
        {"left": [], "right": [b"11", b"22"]},
        {"left": [], "right": [b"33"]},
    ]


def test_runner_rejects_a_nonpositive_bound():
    with pytest.raises(ValueError, match="max_bundle_bytes must be positive"):
        LocalRunner(max_bundle_bytes=0)


class MeasureBundle(beam.DoFn):
    """(key, values) -> (key, number of values, worker pid, the worker's MALLOC_ARENA_MAX); the
    bytes of values each bundle was given go to a Beam distribution. Each bundle sleeps a little
    so that every worker gets bundles to run."""

    def start_bundle(self):
        self._bytes = 0

    def process(self, item):
        key, values = item
        values = list(values)
        self._bytes += sum(len(v) for v in values)
        Metrics.counter("test", "values").inc(len(values))
        yield key, len(values), os.getpid(), os.environ.get("MALLOC_ARENA_MAX")

    def finish_bundle(self):
        Metrics.distribution("test", "bundle_bytes").update(self._bytes)
        time.sleep(0.05)  # longer than a worker takes to pull a bundle: both get some


def _options(mode: str) -> PipelineOptions:
    return PipelineOptions([], direct_num_workers=2, direct_running_mode=mode)


@pytest.fixture(scope="module")
def bounded_run():
    """One pipeline, 2 worker processes, through the bounded runner."""
    runner = LocalRunner(max_bundle_bytes=MAX_BUNDLE_BYTES)
    pipeline = beam.Pipeline(runner=runner, options=_options("multi_processing"))
    values = [(k, b"v" * VALUE_BYTES) for k in range(NUM_KEYS) for _ in range(VALUES_PER_KEY)]
    measured = pipeline | beam.Create(values) | beam.GroupByKey() | beam.ParDo(MeasureBundle())
    counts = measured | beam.Map(lambda row: (row[0], row[1]))
    assert_that(counts, equal_to([(k, VALUES_PER_KEY) for k in range(NUM_KEYS)]))
    result = pipeline.run()
    result.wait_until_finish()
    return result


def _query(result, name):
    return result.metrics().query(MetricsFilter().with_namespace("test").with_name(name))


def test_no_bundle_exceeds_the_bound_and_every_value_arrives_once(bounded_run):
    result = bounded_run  # assert_that (every key once, with all its values) ran in it
    (distribution,) = _query(result, "bundle_bytes")["distributions"]
    total = NUM_KEYS * VALUES_PER_KEY * VALUE_BYTES
    assert distribution.committed.sum == total
    assert distribution.committed.max <= MAX_BUNDLE_BYTES
    assert distribution.committed.count >= total // MAX_BUNDLE_BYTES
    (counter,) = _query(result, "values")["counters"]
    assert counter.committed == NUM_KEYS * VALUES_PER_KEY  # every bundle's metrics are merged


def test_workers_share_the_bundles_and_get_one_malloc_arena(tmp_path):
    environ_before = dict(os.environ)
    out = tmp_path / "workers"
    runner = LocalRunner(max_bundle_bytes=4 << 10)
    with beam.Pipeline(runner=runner, options=_options("multi_processing")) as pipeline:
        _ = (
            pipeline
            | beam.Create([(k, b"v" * 1000) for k in range(200)])
            | beam.GroupByKey()
            | beam.ParDo(MeasureBundle())
            | beam.Map(lambda row: f"{row[2]} {row[3]}")
            | beam.io.WriteToText(str(out))
        )
    rows = [line.split() for path in tmp_path.glob("workers*") for line in path.open()]
    assert len(rows) == 200
    assert len({pid for pid, _ in rows}) == 2, "both worker processes should have run bundles"
    expected = os.environ.get("MALLOC_ARENA_MAX", WORKER_MALLOC_ENV["MALLOC_ARENA_MAX"])
    assert {arena for _, arena in rows} == {expected}  # ours, unless the user set one
    assert dict(os.environ) == environ_before  # the runner's own environment is left as it was


def test_a_failing_bundle_fails_the_run_with_its_error():
    def explode(item):
        if item[0] == 7:
            raise ValueError("key 7 is bad")
        return item

    pipeline = beam.Pipeline(runner=LocalRunner(max_bundle_bytes=256),
                             options=_options("multi_threading"))
    _ = (
        pipeline
        | beam.Create([(k, b"v" * 100) for k in range(50)])
        | beam.GroupByKey()
        | beam.Map(explode)
    )
    with pytest.raises(Exception, match="key 7 is bad"):
        pipeline.run().wait_until_finish()


def test_work_of_another_bundle_size_is_refused_naming_the_flag(tmp_path):
    """The recorded work of a run with another --local_bundle_mb was refused as differing in
    `max_bundle_bytes`, a name no flag has."""
    from bertforge.pipelines.local.work_dir import WorkConflict

    def fail(item):
        raise RuntimeError("stopped")

    def run(max_bundle_bytes):
        pipeline = beam.Pipeline(runner=LocalRunner(str(tmp_path / "work"),
                                                    max_bundle_bytes=max_bundle_bytes),
                                 options=_options("multi_threading"))
        _ = pipeline | beam.Create([(k, b"v") for k in range(4)]) | beam.GroupByKey() | \
            beam.Map(fail)
        pipeline.run().wait_until_finish()

    with pytest.raises(Exception, match="stopped"):  # its work is kept, to continue
        run(1 << 20)
    with pytest.raises(WorkConflict, match=r"differs in: local_bundle_mb 1\.0 -> 0\.5\)"):
        run(1 << 19)
