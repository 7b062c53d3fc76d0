"""Beam's local FnApiRunner with its memory bounded, its work on disk, and progress to watch.

Beam's FnApiRunner keeps every PCollection between stages in its own process and sends each
worker its whole share of a stage in one message, so both the runner and the workers grew with
the corpus. Here, for every stage that needs no state or timers (all of `prepare`'s):

- the stage's input is read from disk (`pipelines.local.spill`) and cut into bundles of at most
  `max_bundle_bytes`, in a fixed order; each worker pulls the next bundle when it finishes one
  (a thread per worker), so a worker holds one bundle and the runner a bundle per worker;
- each bundle's output goes to files as it arrives, and the bundle is recorded as done
  (`pipelines.local.work_dir`) once its files are on disk;
- a stage's output is the bundles' outputs in bundle order: the next stage's input, and so its
  bundles, are the same in a rerun. A rerun of the same job (`kill -9`, a reboot, Ctrl-C)
  therefore skips every bundle already done and redoes only those in flight;
- a stage's input files are deleted once every stage that reads them is done (side inputs,
  which Beam holds in memory anyway, are kept to the end), so the disk holds about two stages'
  data at a time, not the whole job's.

Which elements share a bundle never changes the job's output: every step of the job is
deterministic per element or per key (see `pipelines.prepare`). Stages with state or timers run
as in Beam (none in `prepare`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from apache_beam.metrics import monitoring_infos
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.portability.fn_api_runner import translations
from apache_beam.runners.portability.fn_api_runner.execution import GroupingBuffer, ListBuffer
from apache_beam.runners.portability.fn_api_runner.fn_runner import BundleManager, FnApiRunner
from apache_beam.runners.worker import bundle_processor

from bertforge.pipelines.local.progress import Progress
from bertforge.pipelines.local.quiet_harness import BEAM_HARNESS_MODULE, QUIET_HARNESS_MODULE
from bertforge.pipelines.local.spill import (
    GroupOutput,
    GroupSpill,
    ListOutput,
    ListSpill,
    SpillFiles,
)
from bertforge.pipelines.local.work_dir import (
    StageDir,
    WorkDir,
    WorkIncomplete,
    decode_bytes,
    encode_bytes,
)

logger = logging.getLogger(__name__)

# 2 MB of encoded input per bundle: ~100 document parts, or one pool or piece. Measured on 107 MB
# of text, 2 workers: the largest worker peaked at 332 MB with 2 MB bundles, 424 MB with 8 MB,
# in the same wall time (35.8 s and 36.8 s).
MAX_BUNDLE_BYTES = 2 << 20
# A stage smaller than MIN_BUNDLES bundles is still cut into about that many, so that it spreads
# over every worker; the cut depends on the data only, never on the number of workers, so that a
# rerun with another --direct_num_workers continues the same bundles.
MIN_BUNDLES = 16
# A bundle's grouping output kept in memory before it is sorted and written as a run.
SORT_BUFFER_BYTES = 32 << 20

# glibc gives each thread of a worker (gRPC, bundle processing) a malloc arena of its own, and
# what one arena frees the others do not reuse: as decoded bundles pass between threads, a
# worker's RSS climbed with every bundle it had seen (295 -> 433 MB from 3.6 to 107 MB of text).
# One arena kept it at 332-338 MB in the same time; a fixed mmap threshold did as well for memory
# but cost 15 % in time. Set for the worker processes (and this runner), where a user has not.
WORKER_MALLOC_ENV = {"MALLOC_ARENA_MAX": "1"}
M_ARENA_MAX = -8  # glibc's mallopt parameter of the same name


# The command FnApiRunner starts its worker processes with (--direct_running_mode
# multi_processing), and ours: the same harness, its logging set up first (quiet_harness).
BEAM_HARNESS_COMMAND = f"{sys.executable} -m {BEAM_HARNESS_MODULE}"
QUIET_HARNESS_COMMAND = f"{sys.executable} -m {QUIET_HARNESS_MODULE}"


def quiet_worker_processes(pipeline_proto) -> None:
    """Start the pipeline's worker processes with `QUIET_HARNESS_COMMAND` where Beam would start
    its own harness (any other environment, a user's included, is left as it is)."""
    for environment in pipeline_proto.components.environments.values():
        if (environment.urn == python_urns.SUBPROCESS_SDK
                and environment.payload == BEAM_HARNESS_COMMAND.encode()):
            environment.payload = QUIET_HARNESS_COMMAND.encode()


class LocalRunner(FnApiRunner):
    """An FnApiRunner whose stages run from and to disk, in bounded bundles, resumably.

    work_dir: where the run's intermediate data and done-markers live (None: a temporary
    directory, removed at the end: no resume). identity: what makes two runs the same job; a
    work directory left by another job is refused (`WorkConflict`) unless start_over.
    """

    def __init__(
        self,
        work_dir: str | None = None,
        identity: dict[str, Any] | None = None,
        *,
        start_over: bool = False,
        max_bundle_bytes: int = MAX_BUNDLE_BYTES,
        sort_buffer_bytes: int = SORT_BUFFER_BYTES,
        progress: Progress | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if max_bundle_bytes <= 0:
            raise ValueError(f"max_bundle_bytes must be positive, got {max_bundle_bytes}")
        self._work_dir = work_dir
        # Under the flag's name and unit: a changed --local_bundle_mb is named as typed when
        # the next run refuses the work recorded by this one.
        self._identity = {**(identity or {}), "local_bundle_mb": max_bundle_bytes / 2**20}
        self._start_over = start_over
        self._max_bundle_bytes = max_bundle_bytes
        self._sort_buffer_bytes = sort_buffer_bytes
        self._progress = progress or Progress(enabled=False)
        self.work: WorkDir | None = None
        self.num_bundles_run = self.num_bundles_reused = 0  # reused: done by an earlier run

    def run_pipeline(self, pipeline, options):
        temporary = self._work_dir is None
        root = tempfile.mkdtemp(prefix="bertforge-work-") if temporary else self._work_dir
        self.work = WorkDir(root, self._identity)
        if self.work.open(start_over=self._start_over or temporary):
            logger.info("continuing the run whose work is in %s", root)
        # Workers start during the run and read the allocator settings from their environment;
        # this process's threads (gRPC's, a bundle thread per worker) are created from here on.
        _one_malloc_arena()
        saved = {name: os.environ.get(name) for name in WORKER_MALLOC_ENV}
        os.environ.update({k: v for k, v in WORKER_MALLOC_ENV.items() if saved[k] is None})
        try:
            with self._progress:
                result = super().run_pipeline(pipeline, options)
        except BaseException:
            if temporary:
                self.work.discard()
            raise
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
        self.work.discard()  # done: nothing to continue
        if self.num_bundles_reused:
            logger.info("continued an earlier run: %d bundles it had done reused, %d run now",
                        self.num_bundles_reused, self.num_bundles_run)
        return result

    def run_via_runner_api(self, pipeline_proto, options):
        quiet_worker_processes(pipeline_proto)
        return super().run_via_runner_api(pipeline_proto, options)

    def _get_bundle_manager(self, bundle_context_manager):
        stage = bundle_context_manager.stage
        if stage.is_stateful() or bundle_context_manager.stage_timer_outputs:
            # State is per key and a key must not run in two bundles at once: Beam's own path.
            return super()._get_bundle_manager(bundle_context_manager)
        return SpillingStageManager(
            bundle_context_manager,
            self._progress_frequency,
            cache_token_generator=FnApiRunner.get_cache_token_generator(static=False),
            runner=self,
        )


def _one_malloc_arena() -> None:
    """The runner's threads pass decoded bundles between them too: one malloc arena for the
    threads made from now on, as for the workers (the runner peaked at ~550 MB instead of ~640
    on 30 MB of text), unless the user set MALLOC_ARENA_MAX. glibc only; elsewhere nothing."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


class SpillingStageManager(BundleManager):
    """Runs one whole stage: bundles from disk, outputs to disk, done bundles skipped."""

    def __init__(self, bundle_context_manager, progress_frequency, *, cache_token_generator,
                 runner: LocalRunner):
        super().__init__(
            bundle_context_manager, progress_frequency, cache_token_generator=cache_token_generator
        )
        self._runner = runner
        stage = bundle_context_manager.stage
        self._label = stage_label(stage)
        self._stage = runner.work.stage(self._label, [t.unique_name for t in stage.transforms])
        self._execution = bundle_context_manager.execution_context
        # Read again whenever their producing stage is loaded as done: kept to the end.
        self._side_inputs = _side_input_buffers(self._execution)

    def process_bundle(
        self, inputs, expected_outputs, fired_timers, expected_output_timers, dry_run=False
    ):
        completed = self._stage.completed()
        if completed is not None:  # in an earlier run
            progress = self._runner._progress
            progress.stage_started(self._label, 0, len(self._execution.stages))
            progress.bundle_done(0, _response(completed["metrics"]), resumed=True)
            self._runner.num_bundles_reused += completed["num_bundles"]
        else:
            completed = self._run_stage(inputs, expected_outputs, expected_output_timers, dry_run)
        self._install_outputs(completed["outputs"], expected_outputs)
        self._release(inputs)
        return _response(completed["metrics"]), []

    def _run_stage(self, inputs, expected_outputs, expected_output_timers, dry_run) -> dict:
        total = sum(_num_bytes(buffer) for buffer in inputs.values())
        max_bytes = max(1, min(self._runner._max_bundle_bytes, -(-total // MIN_BUNDLES)))
        bundles = numbered_bundles(inputs, max_bytes)
        progress = self._runner._progress
        progress.stage_started(self._label, total, len(self._execution.stages))
        started = time.monotonic()
        done: dict[int, dict] = {}
        errors: list[BaseException] = []
        lock = threading.Lock()

        def next_bundle():
            """The next bundle not done yet; those done in an earlier run are taken as they are."""
            with lock:
                for index, bundle, size in bundles:
                    record = self._stage.done_bundle(index)
                    if record is None:
                        return index, bundle, size
                    done[index] = record
                    self._runner.num_bundles_reused += 1
                    progress.bundle_done(size, _response(record["metrics"]), resumed=True)
                return None

        def drain(handler) -> None:
            # A thread per worker, pinned to it: bundles never queue on one worker while another
            # idles, as they could if each bundle picked its worker round-robin.
            pinned = _PinnedContext(self.bundle_context_manager, handler)
            manager = BundleManager(pinned, self._progress_frequency,
                                    cache_token_generator=self._cache_token_generator)
            while not errors:
                try:
                    work = next_bundle()
                    if work is None:
                        return
                    index, bundle, size = work
                    outputs = BundleOutputs(self._stage, index, self._runner._sort_buffer_bytes,
                                            self._execution)
                    pinned.outputs = outputs
                    try:
                        result, _ = manager.process_bundle(
                            bundle, expected_outputs, {}, expected_output_timers, dry_run)
                    except BaseException:
                        outputs.abandon()
                        raise
                    record = {"outputs": outputs.finish(),
                              "metrics": encode_bytes(result.SerializeToString())}
                    self._stage.commit_bundle(index, record)
                    with lock:
                        done[index] = record
                        self._runner.num_bundles_run += 1
                    progress.bundle_done(size, result)
                except BaseException as error:  # re-raised below, once every thread has stopped
                    errors.append(error)
                    return

        handlers = self.bundle_context_manager.worker_handlers
        threads = [threading.Thread(target=drain, args=(h,), daemon=True) for h in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            error = errors[0]
            if isinstance(error, FileNotFoundError) and \
                    str(error.filename or "").startswith(self._runner.work.root):
                raise WorkIncomplete(
                    f"the work of an earlier run in {self._runner.work.root} misses "
                    f"{error.filename}; it was discarded: the same command starts over"
                ) from error
            raise error
        ordered = [done[index] for index in sorted(done)]
        completed = {
            "num_bundles": len(ordered),
            "outputs": _stage_outputs(ordered),
            "metrics": encode_bytes(_merge([_response(r["metrics"]) for r in ordered])
                                    .SerializeToString()),
        }
        self._stage.commit(completed)
        progress.stage_done()
        logger.debug("stage %s: %d bundles, %.1f MB in, %.1f s, runner RSS %.0f MB", self._label,
                     len(ordered), total / 1e6, time.monotonic() - started, _rss_mb())
        return completed

    def _install_outputs(self, outputs: dict, expected_outputs) -> None:
        """The stage's outputs, as spills, where Beam's runner looks for its output buffers."""
        pcoll_buffers = self._execution.pcoll_buffers
        installed = set()
        for transform_id, buffer_id in expected_outputs.items():
            if isinstance(transform_id, tuple) or buffer_id in installed:
                continue  # a timer family (not run here), or a second step into one buffer
            installed.add(buffer_id)
            spill = self._spill(outputs.get(_text(buffer_id)), buffer_id, transform_id)
            if isinstance(pcoll_buffers.get(buffer_id), ListSpill | GroupSpill):
                pcoll_buffers[buffer_id].extend(spill)
            else:
                pcoll_buffers[buffer_id] = spill

    def _spill(self, output: dict | None, buffer_id: bytes, transform_id: str):
        kind, name = translations.split_buffer_id(buffer_id)
        keep = buffer_id in self._side_inputs
        if kind == "group":
            runs = [self._stage.file(run) for run in (output or {}).get("runs", [])]
            return GroupSpill(runs, *grouping_coders(self._execution, name),
                              [SpillFiles(runs, keep)])
        files = [(self._stage.file(f), lengths) for f, lengths in (output or {}).get("files", [])]
        return ListSpill(files, self.bundle_context_manager.get_input_coder_impl(transform_id),
                         [SpillFiles([path for path, _ in files], keep)])

    @staticmethod
    def _release(inputs: Mapping[str, Any]) -> None:
        """This stage is done with its inputs: their files go once no other stage needs them."""
        for buffer in inputs.values():
            if isinstance(buffer, ListSpill | GroupSpill):
                buffer.release()


def _side_input_buffers(execution) -> set[bytes]:
    return {buffer_id for by_stage in execution.side_input_descriptors_by_stage.values()
            for buffer_id, _ in by_stage.values()}


class BundleOutputs:
    """Where one bundle's outputs go: a file (or sorted runs) per output PCollection."""

    def __init__(self, stage: StageDir, index: int, sort_buffer_bytes: int, execution):
        self._stage = stage
        self._prefix = stage.bundle_prefix(index)
        self._sort_buffer_bytes = sort_buffer_bytes
        self._execution = execution
        self._writers: dict[bytes, ListOutput | GroupOutput] = {}

    def writer(self, buffer_id: bytes) -> ListOutput | GroupOutput:
        if buffer_id not in self._writers:
            kind, name = translations.split_buffer_id(buffer_id)
            path = f"{self._prefix}.{len(self._writers)}"
            if kind == "group":
                pre, _, _ = grouping_coders(self._execution, name)
                self._writers[buffer_id] = GroupOutput(path, pre, self._sort_buffer_bytes)
            elif kind == "materialize":
                self._writers[buffer_id] = ListOutput(path + ".list")
            else:
                raise NotImplementedError(f"output {buffer_id!r} of a spilled stage")
        return self._writers[buffer_id]

    def finish(self) -> dict:
        return {_text(buffer_id): w.finish() for buffer_id, w in self._writers.items()}

    def abandon(self) -> None:
        for writer in self._writers.values():
            writer.abandon()


class _PinnedContext:
    """A stage's BundleContextManager that offers Beam's BundleManager one worker only, and sends
    the outputs of the bundle in hand to that bundle's files."""

    def __init__(self, context, handler):
        self._context = context
        self.worker_handlers = [handler]
        self.outputs: BundleOutputs | None = None

    def get_buffer(self, buffer_id: bytes, transform_id: str):
        return self.outputs.writer(buffer_id)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def grouping_coders(execution, gbk_transform: str):
    """(pre-grouping coder, post-grouping coder, windowing) of a GroupByKey, as Beam's runner
    finds them for its GroupingBuffer (`BundleContextManager.get_buffer`)."""
    transform = execution.pipeline_components.transforms[gbk_transform]
    (input_pcoll,) = transform.inputs.values()
    (output_pcoll,) = transform.outputs.values()
    coders = execution.pipeline_context.coders

    def coder_of(pcoll):
        return coders[execution.safe_coders[execution.data_channel_coders[pcoll]]]

    windowing = execution.pipeline_context.windowing_strategies[
        execution.safe_windowing_strategies[
            execution.pipeline_components.pcollections[input_pcoll].windowing_strategy_id]]
    return coder_of(input_pcoll), coder_of(output_pcoll), windowing


def numbered_bundles(inputs: Mapping[str, Any], max_bytes: int
                     ) -> Iterator[tuple[int, dict[str, list[bytes]], int]]:
    """(index, {input: chunks}, bytes) of consecutive parts packed into bundles of <= max_bytes.

    Inputs are taken one after the other, in name order; a part larger than max_bytes is a
    bundle of its own (an element, or a key's group, is never cut). A stage whose input is empty
    still runs one (empty) bundle, as Beam does.
    """
    names = sorted(inputs)
    current: dict[str, list[bytes]] = {name: [] for name in names}
    size = index = 0
    for name in names:
        for chunks, part_size in parts_of(inputs[name], max_bytes):
            if size and size + part_size > max_bytes:
                yield index, current, size
                index += 1
                current, size = {n: [] for n in names}, 0
            current[name].extend(chunks)
            size += part_size
    if size or index == 0:
        yield index, current, size


def parts_of(buffer, max_bytes: int) -> Iterator[tuple[list[bytes], int]]:
    """A stage input as ([chunk], size) parts of whole elements (or keys)."""
    if isinstance(buffer, ListSpill | GroupSpill):
        yield from buffer.parts(max_bytes)
    elif isinstance(buffer, GroupingBuffer):  # from a stage Beam ran (state, timers)
        for chunk in buffer.partition(1)[0]:
            yield [chunk], len(chunk)
    else:  # a ListBuffer: an impulse, or a stage's deferred input
        for chunk in buffer:
            yield [chunk], len(chunk)


def _num_bytes(buffer) -> int:
    if isinstance(buffer, ListSpill | GroupSpill):
        return buffer.num_bytes
    if isinstance(buffer, ListBuffer):
        return sum(map(len, buffer))
    return 0


# Steps that every stage has some of (Beam's plumbing and the parts of its composites).
_GENERIC_STEPS = {"PrepareDataset", "Impulse", "InjectDefault", "KeyWithVoid", "CombinePerKey",
                  "Precombine", "Merge", "ExtractOutputs", "UnKey", "DoOnce", "GroupByKey"}


def stage_label(stage) -> str:
    """What a stage does, in the job's words: its first own step (`TokenizeParts`)."""
    plumbing = {bundle_processor.DATA_INPUT_URN, bundle_processor.DATA_OUTPUT_URN}
    for transform in stage.transforms:
        name = transform.unique_name
        if transform.spec.urn in plumbing or name.endswith(("/Read", "/Write", "/Impulse")) \
                or "Reshuffle" in name or "RandomKeys" in name:
            continue
        steps = [step for step in name.split("/")
                 if step[:1].isupper() and "(" not in step and step not in _GENERIC_STEPS]
        if steps:
            return steps[-1]
    return "a step of Beam's"


def _rss_mb() -> float:
    """This process's resident memory now (Linux), for the debug log; 0 elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError):
        return 0.0


def _text(buffer_id: bytes) -> str:
    return buffer_id.decode("latin-1") if isinstance(buffer_id, bytes) else str(buffer_id)


def _stage_outputs(records: list[dict]) -> dict:
    """Every bundle's outputs, in bundle order, per output PCollection."""
    outputs: dict[str, dict] = {}
    for record in records:
        for buffer_id, output in record["outputs"].items():
            merged = outputs.setdefault(buffer_id, {"kind": output["kind"]})
            key = "runs" if output["kind"] == "group" else "files"
            merged.setdefault(key, []).extend(output[key])
    return outputs


def _response(metrics: str | beam_fn_api_pb2.InstructionResponse
              ) -> beam_fn_api_pb2.InstructionResponse:
    if isinstance(metrics, beam_fn_api_pb2.InstructionResponse):
        return metrics
    return beam_fn_api_pb2.InstructionResponse.FromString(decode_bytes(metrics))


def _merge(results: list) -> beam_fn_api_pb2.InstructionResponse:
    """One response for the stage: every bundle's metrics (as Beam merges them) and residuals."""
    merged = beam_fn_api_pb2.InstructionResponse(
        process_bundle=beam_fn_api_pb2.ProcessBundleResponse(
            monitoring_infos=monitoring_infos.consolidate(
                info for result in results for info in result.process_bundle.monitoring_infos
            )
        )
    )
    for result in results:
        merged.process_bundle.residual_roots.extend(result.process_bundle.residual_roots)
    return merged
