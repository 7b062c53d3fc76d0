"""One epoch's batches from a position, prepared ahead by a background thread.

The thread only prepares (gather, pad, mask: numpy and CPU tensors); the consumer decides when
a batch counts as handed out, so a checkpoint taken mid-epoch records what the training loop
saw, never what was merely prefetched. A thread per live iterator, stopped when the iterator
is closed or dropped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

THREAD_NAME = "bertforge-prefetch"


class _Failure:
    """An exception raised in the prefetch thread, carried to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


def _produce(
    make_batch: Callable[[int], Any],
    batches: range,
    out: queue.Queue,
    stop: threading.Event,
) -> None:
    """The prefetch thread: prepare batches in order; stop promptly when told."""
    for index in batches:
        try:
            item: Any = make_batch(index)
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            item = _Failure(error)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if stop.is_set() or isinstance(item, _Failure):
            return


class BatchIterator:
    """Yields `make_batch(i)` for i in [start, end); calls `handed_out(i + 1)` after each.

    With `prefetch` > 0, up to that many batches are prepared ahead by a daemon thread;
    with 0 they are prepared inline.
    """

    def __init__(
        self,
        make_batch: Callable[[int], Any],
        start: int,
        end: int,
        prefetch: int,
        handed_out: Callable[[int], None],
    ):
        self._closed = False  # first: __del__ runs even if the rest fails
        self._replaced_why: str | None = None
        self._queue: queue.Queue | None = None
        self._make_batch, self._handed_out = make_batch, handed_out
        self._next, self._end = start, end
        if prefetch > 0 and start < end:
            self._queue = queue.Queue(maxsize=prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_produce,
                args=(make_batch, range(start, end), self._queue, self._stop),
                name=THREAD_NAME,
                daemon=True,  # never keeps the interpreter alive
            )
            self._thread.start()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Any:
        if self._replaced_why is not None:
            raise RuntimeError(self._replaced_why)
        if self._closed or self._next >= self._end:
            self.close()
            raise StopIteration
        if self._queue is None:
            item: Any = self._make_batch(self._next)
        else:
            item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        self._next += 1
        self._handed_out(self._next)  # counted when handed out, not when prepared
        return item

    def replaced(self, why: str) -> None:
        """Closed because another iterator took over the position: each later `next` raises
        `why` (ending quietly would hand the consumer a shorter epoch without a word). One that
        had ended already stays ended."""
        if self._closed:
            return
        self.close()
        self._replaced_why = why

    def close(self) -> None:
        """Stop the prefetch thread and wait for it; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:
            self._stop.set()
            self._thread.join()

    def __del__(self) -> None:
        self.close()
