"""Every collective the loop issues gets tensors on the engine's device (issue 11, item 1).

An NCCL process group has no CPU backend: a CPU tensor given to `all_reduce` while training on
CUDA fails there. A CPU test cannot see that directly (gloo takes CPU tensors, and the engine's
device *is* the CPU), so this test recreates the one condition that matters on a GPU: a tensor
made without a device argument lands somewhere other than where the engine trains.

- From the moment the engine exists, `torch.set_default_device("meta")`: a tensor made with no
  device argument is a meta tensor, as it is a CPU tensor in a CUDA run. (Thread-local: the
  loader's prefetch thread, which builds CPU batches on purpose, is unaffected.)
- Every torch.distributed collective is wrapped: each tensor it receives must be on the device
  the engine reports (`engine.device`), checked before the call reaches gloo.

The real loop runs (training, validation, checkpoint save and a resume), single process, gloo.
Before issue 11 `_Window` and `evaluate` summed metrics in `torch.zeros(7, dtype=float64)`:
here those are meta tensors and the wrapper fails on the metrics all-reduce at the first log
step, naming it.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist

from bertforge.training import distributed, loop
from bertforge.training.config import TrainConfig
from bertforge.training.metrics import read_metrics
from tests.training.conftest import write_dataset

# Every collective torch.distributed offers that takes tensors (DeepSpeed's comm layer calls
# these too, so its own collectives are held to the same rule). barrier takes none.
TENSOR_COLLECTIVES = (
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "_all_gather_base", "_reduce_scatter_base", "all_reduce_coalesced",
)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(loop.__file__)))
PACKAGES = ("training/", "cluster/", "pipelines/")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _our_callers() -> set[str]:
    """bertforge modules on the stack (training/loop.py, ...), relative to the package."""
    paths = (os.path.relpath(frame.filename, PACKAGE_ROOT) for frame in traceback.extract_stack())
    return {path for path in paths if path.startswith(PACKAGES)}


class CollectiveGuard:
    """Wraps torch.distributed's collectives; fails any call with a tensor off `self.device`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.device: torch.device | None = None  # set once the engine exists
        self.calls: list[tuple[str, frozenset[str]]] = []
        for name in TENSOR_COLLECTIVES:
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name)))
        monkeypatch.setattr(dist, "barrier", self._wrap("barrier", dist.barrier))

    def _wrap(self, name, real):
        def checked(*args, **kwargs):
            if self.device is not None:
                for tensor in _tensors([*args, *kwargs.values()]):
                    assert tensor.device == self.device, (
                        f"dist.{name} got a tensor on {tensor.device}, but the engine trains on "
                        f"{self.device}; called from {sorted(_our_callers())}"
                    )
                self.calls.append((name, frozenset(_our_callers())))
            return real(*args, **kwargs)

        return checked

    def callers_of(self, name: str) -> set[str]:
        return set().union(*(callers for called, callers in self.calls if called == name))


@pytest.fixture
def guard(monkeypatch):
    guard = CollectiveGuard(monkeypatch)
    real_build = loop.build_engine

    def build_engine(*args, **kwargs):
        engine = real_build(*args, **kwargs)
        guard.device = torch.device(engine.device)
        # From here on, "no device argument" means "not on the engine's device", as on CUDA.
        torch.set_default_device("meta")
        return engine

    monkeypatch.setattr(loop, "build_engine", build_engine)
    try:
        yield guard
    finally:
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [70, 60], "validation": [40]}, max_seq_length=64)


def _config(data_dir, run_dir, **overrides) -> TrainConfig:
    values = dict(
        data_dir=data_dir, run_dir=str(run_dir), max_steps=4, micro_batch_size=8,
        warmup_steps=1, learning_rate=1e-3, log_every=2, eval_every=2, eval_batches=2,
        checkpoint_every=2, zero_stage=2, precision="bf16",
        model={"preset": "tiny", "hidden_size": 32, "num_attention_heads": 2,
               "intermediate_size": 64},
    )
    values.update(overrides)
    return TrainConfig(**values)


def test_every_collective_of_the_loop_gets_tensors_on_the_engine_device(guard, dataset, tmp_path):
    run_dir = tmp_path / "run"
    loop.train(_config(dataset, run_dir))
    torch.set_default_device(None)
    loop.train(_config(dataset, run_dir, max_steps=6))  # resume: checkpoint load and barriers
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 4, 6]
    assert [r["step"] for r in records if "eval_mlm_accuracy" in r] == [2, 4, 6]
    # The guard saw the collectives it is here for (so it cannot pass by seeing none).
    reducers = guard.callers_of("all_reduce")
    assert "training/loop.py" in reducers  # the metrics window
    assert "training/evaluate.py" in reducers  # validation
    assert "training/checkpoint.py" in guard.callers_of("barrier")


def test_barrier_names_the_engine_device_on_nccl(monkeypatch):
    """NCCL's barrier runs a 1-element all-reduce on a GPU it guesses (rank % GPUs, with a
    warning) unless told: the helper names the engine's; gloo takes no device_ids."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda **kwargs: calls.append(kwargs))
    distributed.barrier(torch.device("cuda", 3))
    distributed.barrier(torch.device("cpu"))
    assert calls == [{"device_ids": [3]}, {}]


def test_all_reduce_refuses_a_tensor_off_the_device(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor: None)
    with pytest.raises(AssertionError, match="meta"):
        distributed.all_reduce_sum(torch.zeros(2, device="meta"), torch.device("cpu"))
