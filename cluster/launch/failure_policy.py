"""Retry what a restart can fix (a crashed worker, a lost node), never a user error.

Ray Train V2's `FailureConfig(max_failures=N)` restarts the worker group on any worker error;
a wrong dataset or an architecture mismatch then fails N + 1 times, minutes each. Its failure
policy is chosen by `create_failure_policy`, which `DataParallelTrainer.fit` looks up in its
module at call time and Ray offers no public hook for (ray 2.60): `user_errors_fail_at_once`
swaps in a policy that raises at once when any worker failed with a
`training.errors.UserInputError`, and otherwise decides as Ray's default. The policy travels
to Ray Train's controller actor by reference, so bertforge must be importable there (it is
wherever the workers run). On a Ray without that hook everything is retried, as before.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
    FailureDecision,
)
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError

from bertforge.training.errors import UserInputError

logger = logging.getLogger(__name__)


def user_error_of(error: BaseException) -> UserInputError | None:
    """The first worker's UserInputError inside a Ray Train failure, if there is one."""
    if isinstance(error, WorkerGroupError):
        for failure in error.worker_failures.values():
            if isinstance(failure, UserInputError):
                return failure
    return None


# Ray's memory monitor, in the error of every task or actor it kills: "... killed due to the node
# running low on memory. Memory on the node (IP: ..., ID: ...) was 22.47GB used / 23.54GB limit"
_OUT_OF_MEMORY = re.compile(r"running low on memory\..*? was ([\d.]+ ?GB used / [\d.]+ ?GB limit)",
                            re.DOTALL)


def out_of_memory_of(error: BaseException) -> UserInputError | None:
    """A Ray Train failure whose workers Ray's memory monitor killed (the controller then
    fails with their error), as one line that says what to change; None for any other failure.
    Before, such a run ended with Ray's traceback of some 40 lines, the node's memory table
    among them, in the run's log only."""
    found = _OUT_OF_MEMORY.search(str(error))
    if found is None:
        return None
    return UserInputError(
        f"Ray stopped the run: the node ran low on memory ({found.group(1)}) and its memory "
        "monitor killed the workers; lower the micro-batch, the workers on one machine or the "
        "model's size, or give each worker more memory (Ray's report is in the run's log)")


class UserErrorsFailAtOnce(DefaultFailurePolicy):
    """Ray's default policy, except that a user error ends the run on its first occurrence."""

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        user_error = user_error_of(training_failed_error)
        if user_error is not None:
            logger.error("not retried (retrying cannot fix it): %s", user_error)
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


@contextlib.contextmanager
def user_errors_fail_at_once() -> Iterator[None]:
    """Within: trainers fit under `UserErrorsFailAtOnce`, and a run ended by a user error
    raises that error itself (one line at the command line), not Ray's wrapper."""
    try:
        from ray.train.v2.api import data_parallel_trainer as trainer_module
    except ImportError:  # another Ray layout: keep its own policy
        trainer_module = None
    original = getattr(trainer_module, "create_failure_policy", None)
    if original is not None:
        trainer_module.create_failure_policy = UserErrorsFailAtOnce
    try:
        yield
    except TrainingFailedError as error:
        user_error = user_error_of(error) or out_of_memory_of(error)
        if user_error is None:
            raise
        raise user_error from error
    finally:
        if original is not None:
            trainer_module.create_failure_policy = original
