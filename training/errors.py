"""Errors that retrying cannot fix: bad data, a bad config, another architecture.

A worker that raises one of these fails the same way on every attempt, so the launcher ends
the run at once instead of spending its restarts (`cluster.launch.failure_policy`); only crashes and
lost nodes are worth a retry. They are `ValueError`s, so the command line prints them as one
line like any other user error.
"""

from __future__ import annotations

import errno

from bertforge.pipelines.contract.disk_space import exception_chain


class UserInputError(ValueError):
    """The run's inputs (data, vocabulary, config, run directory) are wrong: do not retry."""


class MissingInputError(UserInputError, FileNotFoundError):
    """A file the inputs name does not exist (also a FileNotFoundError)."""


class DivergedError(UserInputError):
    """The loss is no longer a number: a retry, from the same checkpoint with the same data and
    settings, diverges the same way."""


def disk_full(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is a full disk or quota: an OSError's errno,
    or the OS's words in the message of a library that drops the errno (safetensors)."""
    for seen in exception_chain(error):
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
    return False


def first_line(error: BaseException) -> str:
    """An error's message's first line (engines put tracebacks and HTTP replies in theirs)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def as_user_error(error: Exception) -> UserInputError:
    """`error` as a UserInputError with the same message (a missing file stays one)."""
    if isinstance(error, UserInputError):
        return error
    if isinstance(error, FileNotFoundError):
        return MissingInputError(str(error))
    return UserInputError(str(error))
