"""A local run's progress: a line every `interval` seconds, from the bundles done so far.

    prepare: TokenizeParts (stage 8 of 36), 85% of 2503.6 MB in 9 min 59 s, 3.6 MB/s, ETA 1 min
    43 s; 503,681 documents (2,400 MB) read, 0 kept, 0 instances; 10 min 50 s in

The stage's share comes from the bytes of its input that bundles finished; the rest of the line
(`describe`) from the job's Beam counters summed over the bundles done (resumed ones included).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from apache_beam.metrics import monitoring_infos

logger = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0


def format_size(num_bytes: float, megabytes_from: float, spec: str) -> str:
    """MB in `spec` from `megabytes_from` bytes up, kB or bytes below: a small input is never
    '0 MB'."""
    if num_bytes >= megabytes_from:
        return f"{num_bytes / 1e6:{spec}} MB"
    if num_bytes >= 1e3:
        return f"{num_bytes / 1e3:,.0f} kB"
    return f"{num_bytes:,.0f} bytes"


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Counts what bundles finish; a thread writes the line while the run lasts (`with`)."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        namespace: str = "",
        describe: Callable[[Counter], str] = lambda counters: "",
        interval: float = PROGRESS_SECONDS,
        prefix: str = "",
        emit: Callable[[str], None] | None = None,
    ):
        self.enabled = enabled
        self._namespace = namespace
        self._describe = describe
        self._interval = interval
        self._prefix = prefix
        self._emit = emit or logger.info
        self.counters: Counter = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run_start = time.monotonic()
        self._stage = ""
        self._stage_number = self._num_stages = 0
        self._stage_bytes = self._stage_done_bytes = self._resumed_bytes = 0
        self._stage_start = self._run_start

    def __enter__(self) -> Progress:
        self._run_start = time.monotonic()
        if self.enabled:
            self._stop.clear()
            self._thread = threading.Thread(target=self._report, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def stage_started(self, label: str, total_bytes: int, num_stages: int = 0) -> None:
        with self._lock:
            self._stage, self._stage_number = label, self._stage_number + 1
            self._num_stages = num_stages
            self._stage_bytes, self._stage_done_bytes, self._resumed_bytes = total_bytes, 0, 0
            self._stage_start = time.monotonic()

    def bundle_done(self, num_bytes: int, result, resumed: bool = False) -> None:
        with self._lock:
            self._stage_done_bytes += num_bytes
            if resumed:
                self._resumed_bytes += num_bytes
            self.counters.update(self._user_counters(result))

    def stage_done(self) -> None:
        with self._lock:
            self._stage_done_bytes = self._stage_bytes

    def line(self) -> str:
        with self._lock:
            now = time.monotonic()
            text = f"{self._prefix}{self._stage or 'starting'}"
            if self._stage:
                of = f" of {self._num_stages}" if self._num_stages else ""
                text += f" (stage {self._stage_number}{of}), " + self._stage_share(now)
            described = self._describe(self.counters)
            text += (f"; {described}" if described else "") + \
                f"; {format_seconds(now - self._run_start)} in"
        return text

    def _stage_share(self, now: float) -> str:
        total, done = self._stage_bytes, self._stage_done_bytes
        elapsed = now - self._stage_start
        if total == 0:  # its input not sized yet: "0% of 0.0 MB" would say nothing true
            return f"{format_seconds(elapsed)} in this stage"
        share = f"{100 * done // total}% of {format_size(total, 0.05e6, '.1f')} in " \
            f"{format_seconds(elapsed)}"
        worked = done - self._resumed_bytes  # bytes done in this run: the rate to go by
        if worked > 0 and elapsed > 0 and done < total:
            rate = worked / elapsed
            share += f", {rate / 1e6:.1f} MB/s, ETA {format_seconds((total - done) / rate)}"
        return share

    def _report(self) -> None:
        while not self._stop.wait(self._interval):
            self._emit(self.line())

    def _user_counters(self, result) -> Counter:
        counters: Counter = Counter()
        for info in result.process_bundle.monitoring_infos:
            if info.urn != monitoring_infos.USER_COUNTER_URN:
                continue
            if self._namespace and \
                    info.labels.get(monitoring_infos.NAMESPACE_LABEL) != self._namespace:
                continue
            name = info.labels.get(monitoring_infos.NAME_LABEL)
            counters[name] += monitoring_infos.extract_counter_value(info)
        return counters
