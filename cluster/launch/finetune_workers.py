"""Fine-tuning's launch on one machine: how many Ray Train workers, how many threads each.

Pretraining's `LaunchConfig` defaults (2 workers of 1 CPU) stay what they are for `bertforge
train`; fine-tuning on a local Ray takes its defaults from here (`bertforge finetune`, `glue`).
"""

from __future__ import annotations

import os
from typing import Any

from bertforge.cluster.launch.launch_config import LaunchConfig


def local_cores() -> int:
    """The cores this process may run on (its affinity), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def finetune_launch(given: dict[str, Any], cores: int | None = None) -> LaunchConfig:
    """`bertforge finetune` / `glue`'s launch from the flags given (`given_values`).

    On a local Ray of CPU workers (no --address, no --gpu) fine-tuning defaults to ONE worker
    whose torch threads are all the machine's cores, and `--workers N` alone splits the cores
    between them (cores // N threads each); flags given always win. Why (measured on 2 cores
    by benchmarks/finetune_vs_plain_loop.py, numbers in benchmarks/README.md): LaunchConfig's
    2 workers of 1 thread paid a gradient all-reduce and (then the default on several workers)
    DeepSpeed's ZeRO-1 wrapper every step and were slower than one process on 2 threads, and
    one worker on one thread (what `--workers 1` gave before) left half the machine idle
    (issue 24's 1.54x on a 22M model).
    On a cluster (--address) or with --gpu, LaunchConfig's defaults stand.
    """
    if given.get("address") or given.get("gpu"):
        return LaunchConfig(**given)
    workers = given.get("workers", 1)
    # workers below 1: LaunchConfig's own refusal, not a ZeroDivisionError here.
    cpus = given.get("cpus_per_worker", max(1, (cores or local_cores()) // max(workers, 1)))
    return LaunchConfig(**{**given, "workers": workers, "cpus_per_worker": cpus})
