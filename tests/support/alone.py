"""The environment for a script run in a process of its own, as on the lent GPU machine.

Tests in a pytest process set up torch.distributed and leave RANK, MASTER_PORT and the rest in
os.environ: a child process would join (or collide with) that store instead of starting its own
single-rank group. On a CPU test the GPUs are hidden too, so DeepSpeed takes the CPU.
"""

from __future__ import annotations

import os

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def alone_env(**extra: str) -> dict[str, str]:
    """os.environ without the launcher's variables, with no GPU visible, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env
