"""Shard checksums, verified once per file per process, beside training rather than before it.

Hashing a split reads all of it: 10 GB at ~1 GB/s of sha256 is ~10 s of start-up on every
worker if done first. Instead one daemon thread per process streams each shard through sha256
(hashlib and file reads release the GIL, so the first step does not wait) while the loader
already serves batches; those batches are safe from the damage that matters meanwhile,
because every row is validated as it is read (`training.data.integrity`). A mismatch fails the
next batch, naming the file, and the training loop waits for the verdict before it commits a
checkpoint (`ChecksumCheck.wait`), so no checkpoint is ever made from unverified shards.

Each (file, size, mtime, expected hash) is hashed once per process: the train and validation
loaders, re-created loaders and evaluation share the verdicts.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

from bertforge.pipelines.contract.manifest import sha256_file
from bertforge.training.errors import UserInputError

_lock = threading.Lock()
_verdicts: dict[tuple[str, int, int, str], Future] = {}  # None: matches; else the error text


class ChecksumMismatchError(UserInputError):
    """A shard's bytes are not those the manifest recorded: damaged or replaced."""


class ChecksumCheck:
    """The verdicts on one split's shards, arriving in the background."""

    def __init__(self, verdicts: list[Future]):
        self._pending = list(verdicts)

    def raise_if_failed(self) -> None:
        """Raise for any mismatch found so far; never waits (called for every batch)."""
        still = []
        for verdict in self._pending:
            if not verdict.done():
                still.append(verdict)
            elif verdict.result() is not None:
                raise ChecksumMismatchError(verdict.result())
        self._pending = still

    def wait(self) -> None:
        """Block until every shard is hashed; raise for the first mismatch."""
        for verdict in self._pending:
            if verdict.result() is not None:
                raise ChecksumMismatchError(verdict.result())
        self._pending = []

    @property
    def done(self) -> bool:
        return all(verdict.done() for verdict in self._pending)


def verify_in_background(files: list[tuple[str, str]]) -> ChecksumCheck:
    """Start hashing each (path, expected sha256) not yet hashed in this process."""
    verdicts, new = [], []
    with _lock:
        for path, expected in files:
            stat = os.stat(path)
            key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, expected)
            if key not in _verdicts:
                _verdicts[key] = Future()
                new.append((path, expected, _verdicts[key]))
            verdicts.append(_verdicts[key])
    if new:
        # A daemon thread, not an executor: exiting must not wait for a 10 GB hash to finish.
        try:
            threading.Thread(target=_hash_all, args=(new,), name="bertforge-sha256",
                             daemon=True).start()
        except BaseException as error:
            # Unresolved cached futures would make every later wait() block forever.
            _fail_unresolved(new, error)
            raise
    return ChecksumCheck(verdicts)


def _hash_all(jobs: list[tuple[str, str, Future]]) -> None:
    try:
        for path, expected, verdict in jobs:
            verdict.set_result(shard_checksum_problem(path, expected))
    except BaseException as error:
        # Anything but OSError (caught below) must still resolve the futures: wait() is called
        # before every checkpoint and would otherwise block forever without a word. Not
        # re-raised: the error reaches the loader through the futures.
        _fail_unresolved(jobs, error)


def _fail_unresolved(jobs: list[tuple[str, str, Future]], error: BaseException) -> None:
    for _path, _expected, verdict in jobs:
        if not verdict.done():
            verdict.set_exception(error)


def shard_checksum_problem(path: str, expected: str) -> str | None:
    """None when `path` hashes to `expected`; else what is wrong, naming the file."""
    try:
        actual = sha256_file(path)
    except OSError as error:
        return f"shard {path} could not be read to verify its sha256 ({error})"
    if actual != expected:
        return (f"shard {path} does not match its sha256 in the manifest (sha256 "
                f"{actual[:12]}..., manifest {expected[:12]}...): the file is damaged or was "
                "replaced after preparation; prepare it again or restore it")
    return None
