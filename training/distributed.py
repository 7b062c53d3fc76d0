"""The collectives bertforge itself issues, each told the device the engine trains on.

An NCCL process group (what `ensure_process_group` and Ray Train's `TorchConfig(backend="nccl")`
create on CUDA) has no CPU backend: a tensor given to a collective must be on the GPU this
rank trains on. Metric sums are therefore made on `engine.device` by their owners and checked
here before they reach the backend; a CPU test cannot tell a forgotten `device=` from a right
one, so tests/training/test_collective_devices.py makes the difference visible.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def all_reduce_sum(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place; a no-op without a process group."""
    assert tensor.device == torch.device(device), (
        f"a collective on {tensor.device} while training on {device}: NCCL has no CPU backend"
    )
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def barrier(device: torch.device | None) -> None:
    """Wait for every rank; a no-op without a process group.

    NCCL implements a barrier as a 1-element all-reduce on a GPU it must pick: without
    `device_ids` it guesses (the current device, or rank % GPUs, with a warning) and a wrong
    guess hangs or puts a context on another rank's GPU. gloo takes no `device_ids`.
    """
    if not dist.is_initialized():
        return
    if device is not None and torch.device(device).type == "cuda":
        index = torch.device(device).index
        dist.barrier(device_ids=[torch.cuda.current_device() if index is None else index])
    else:
        dist.barrier()


def local_rank() -> int:
    """This process's rank on its node (the launchers' LOCAL_RANK; a lone process: its rank)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return int(os.environ.get("LOCAL_RANK", rank))
