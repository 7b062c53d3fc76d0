"""Beam's local FnApiRunner with every bundle's input bounded, so worker memory is flat.

Beam's FnApiRunner cuts each stage's input into exactly one bundle per worker: after a grouping,
each worker process is sent its whole share of the corpus in one data-plane message and decodes it
there, so a worker's memory grew with the corpus (917 MB per worker on 107 MB of text). Here a
stage's input is cut into many small parts (by key after a grouping, by element otherwise), the
parts are packed into bundles of at most `max_bundle_bytes` encoded bytes, and each worker pulls
the next bundle when it finishes one. That bounds what a worker holds to one bundle plus its own
state, whatever the corpus size, and balances uneven stages better than a fixed half each.

Which elements share a bundle never changes the job's output: every step of the job is
deterministic per element or per key (see `pipelines.prepare`).

What stays as in Beam: the runner process keeps every PCollection in memory (it plays the part
of Dataflow's shuffle service), stateful stages run as one bundle, and timers go with the first
bundle.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from apache_beam.metrics import monitoring_infos
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.portability.fn_api_runner.execution import GroupingBuffer, ListBuffer
from apache_beam.runners.portability.fn_api_runner.fn_runner import BundleManager

logger = logging.getLogger(__name__)

# 2 MB of encoded input per bundle: ~100 document parts, or one pool or piece. Measured on 107 MB
# of text, 2 workers: the largest worker peaked at 332 MB with 2 MB bundles, 424 MB with 8 MB,
# in the same wall time (35.8 s and 36.8 s).
MAX_BUNDLE_BYTES = 2 << 20

# How finely a stage's input is cut before packing. Parts are whole keys (after a grouping) or
# whole elements, so the cut can be no finer than that; 16,384 parts keep bundles within 2 MB up
# to 32 GB of input in one stage, beyond what one machine should prepare.
MAX_PARTS = 16_384

# glibc gives each thread of a worker (gRPC, bundle processing) a malloc arena of its own, and
# what one arena frees the others do not reuse: as decoded bundles pass between threads, a
# worker's RSS climbed with every bundle it had seen (295 -> 433 MB from 3.6 to 107 MB of text).
# One arena kept it at 332-338 MB in the same time; a fixed mmap threshold did as well for memory
# but cost 15 % in time. Set for the worker processes only, where a user has not set it.
WORKER_MALLOC_ENV = {"MALLOC_ARENA_MAX": "1"}


class BoundedBundleRunner(FnApiRunner):
    """An FnApiRunner that sends workers bundles of at most `max_bundle_bytes` each."""

    def __init__(self, max_bundle_bytes: int = MAX_BUNDLE_BYTES, **kwargs: Any):
        super().__init__(**kwargs)
        if max_bundle_bytes <= 0:
            raise ValueError(f"max_bundle_bytes must be positive, got {max_bundle_bytes}")
        self._max_bundle_bytes = max_bundle_bytes

    def run_pipeline(self, pipeline, options):
        # Workers start during the run and read the allocator settings from their environment.
        saved = {name: os.environ.get(name) for name in WORKER_MALLOC_ENV}
        os.environ.update({k: v for k, v in WORKER_MALLOC_ENV.items() if saved[k] is None})
        try:
            return super().run_pipeline(pipeline, options)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)

    def _get_bundle_manager(self, bundle_context_manager):
        if bundle_context_manager.stage.is_stateful():
            # State is per key and a key must not run in two bundles at once: Beam's own path.
            return super()._get_bundle_manager(bundle_context_manager)
        return BoundedBundleManager(
            bundle_context_manager,
            self._progress_frequency,
            cache_token_generator=FnApiRunner.get_cache_token_generator(static=False),
            max_bundle_bytes=self._max_bundle_bytes,
        )


class BoundedBundleManager(BundleManager):
    """Runs one stage as bounded bundles, each worker pulling the next bundle when free."""

    def __init__(
        self, bundle_context_manager, progress_frequency, *, cache_token_generator, max_bundle_bytes
    ):
        super().__init__(
            bundle_context_manager, progress_frequency, cache_token_generator=cache_token_generator
        )
        self._max_bundle_bytes = max_bundle_bytes

    def process_bundle(
        self, inputs, expected_outputs, fired_timers, expected_output_timers, dry_run=False
    ):
        handlers = self.bundle_context_manager.worker_handlers
        bundles = self._cut(inputs, len(handlers))
        timers = [fired_timers] + [{}] * (len(bundles) - 1)  # timers run once, as in Beam
        work = collections.deque(zip(bundles, timers, strict=True))
        results: list[beam_fn_api_pb2.InstructionResponse] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def drain(handler) -> None:
            # A thread per worker, pinned to it: bundles never queue on one worker while another
            # idles, as they could if each bundle picked its worker round-robin.
            manager = BundleManager(
                _PinnedContext(self.bundle_context_manager, handler),
                self._progress_frequency,
                cache_token_generator=self._cache_token_generator,
            )
            while True:
                with lock:
                    if errors or not work:
                        return
                    bundle, bundle_timers = work.popleft()
                try:
                    result, _ = manager.process_bundle(
                        bundle, expected_outputs, bundle_timers, expected_output_timers, dry_run
                    )
                except BaseException as error:  # re-raised below, once every thread has stopped
                    with lock:
                        errors.append(error)
                    return
                with lock:
                    results.append(result)

        threads = [threading.Thread(target=drain, args=(h,), daemon=True) for h in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return _merge(results), []

    def _cut(self, inputs, num_workers: int) -> list[dict[str, list[bytes]]]:
        """The stage's input as bundles of at most max_bundle_bytes (an element is never cut)."""
        parts = {
            name: buffer.partition(_num_parts(buffer, num_workers, self._max_bundle_bytes))
            for name, buffer in inputs.items()
        }
        total = sum(len(chunk) for p in parts.values() for chunks in p for chunk in chunks)
        # A stage smaller than the bound still spreads over every worker: an even share each.
        share = -(-total // num_workers)
        bundles = pack_bundles(parts, max_bytes=max(1, min(self._max_bundle_bytes, share)))
        logger.debug(
            "stage %s: %d bytes in %d bundles",
            self.bundle_context_manager.stage.name,
            total,
            len(bundles),
        )
        return bundles


def pack_bundles(
    parts: Mapping[str, list[list[bytes]]], max_bytes: int
) -> list[dict[str, list[bytes]]]:
    """Consecutive parts (index i of every input together) packed into bundles of <= max_bytes.

    A part larger than max_bytes is a bundle of its own (an element is never cut). Empty parts are
    skipped; a stage whose input is empty still runs one (empty) bundle, as Beam does.
    """
    num_parts = max((len(p) for p in parts.values()), default=0)
    bundles: list[dict[str, list[bytes]]] = []
    current: dict[str, list[bytes]] = {name: [] for name in parts}
    current_bytes = 0
    for index in range(num_parts):
        part = {name: p[index] if index < len(p) else [] for name, p in parts.items()}
        size = sum(len(chunk) for chunks in part.values() for chunk in chunks)
        if size == 0:
            continue
        if current_bytes and current_bytes + size > max_bytes:
            bundles.append(current)
            current = {name: [] for name in parts}
            current_bytes = 0
        for name, chunks in part.items():
            current[name].extend(chunks)
        current_bytes += size
    if current_bytes or not bundles:
        bundles.append(current)
    return bundles


def _num_parts(buffer, num_workers: int, max_bytes: int) -> int:
    """How many parts to cut a buffer into, each a whole key or element, at most MAX_PARTS."""
    if isinstance(buffer, GroupingBuffer):  # one part per key, counted before it is encoded
        return max(1, min(len(buffer._table), MAX_PARTS))
    if isinstance(buffer, ListBuffer):
        # The encoded chunks workers sent back (~10 MB each at most). With enough small chunks, a
        # chunk a part costs nothing; otherwise Beam re-encodes the elements into the parts.
        chunks = list(buffer)
        if len(chunks) >= num_workers and max(map(len, chunks), default=0) <= max_bytes:
            return len(chunks)
        # Parts of about a quarter bundle: bundles stay within max_bytes, and a small stage is not
        # cut into MAX_PARTS mostly empty parts (16,384 output streams and a packing loop over
        # them, per stage: about a third of the runner's CPU in a job on one document).
        total = sum(map(len, chunks))
        return max(num_workers, min(MAX_PARTS, -(-4 * total // max_bytes)))
    return num_workers  # a kind of buffer this module does not know: Beam's own cut


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


class _PinnedContext:
    """A stage's BundleContextManager that offers Beam's BundleManager one worker only."""

    def __init__(self, context, handler):
        self._context = context
        self.worker_handlers = [handler]

    def __getattr__(self, name: str):
        return getattr(self._context, name)
