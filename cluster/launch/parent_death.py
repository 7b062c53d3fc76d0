"""A process that dies with its parent, however the parent died: the kernel's PR_SET_PDEATHSIG
(Linux; elsewhere nothing is set).

Two users: `local_worker`'s child, whose parent is the driver, and a Ray Train worker of a
private local Ray (`ray_train._worker_main`), whose parent is the raylet. Ray itself ties the
raylet and the GCS to the driver so (its "fate sharing"), but not the workers the raylet starts:
each is a process group of its own, so `kill -9` of the driver's process group missed them, and
they trained on, committing checkpoints, until they noticed that their raylet was gone (3-4 s
of a tiny model's training on 2 cores: five more checkpoints).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """The kernel sends SIGKILL to this process when its parent dies (its thread that started
    this process, strictly: the driver's main thread, the raylet's). Exits at once when the
    parent was gone before that took effect (this process then has another parent: init, or
    a subreaper)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:
        sys.exit(1)
