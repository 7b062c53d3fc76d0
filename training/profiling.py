"""`--profile-steps FIRST LAST`: torch.profiler over optimizer steps FIRST..LAST of a real run.

A benchmark's step is not the loop's: the loop also loads and moves batches, sums its metrics,
writes log lines, evaluates and saves checkpoints. Whether those stall the GPU shows only in a
profile of the loop itself. For each profiled step this records its host time and the syncs it
made the host wait for (a step that waits for the device idles it while Python catches up);
over the window, the wall time a step, the kernels a step, the GPU's busy share and the kernel
time by category (`CATEGORIES`, shared with `benchmarks/gpu_profile.py`).

Written per rank to RUN_DIR/profile/: `steps-F-L-rank<R>.json` (the summary) and
`trace-steps-F-L-rank<R>.json.gz` (the whole trace, for Perfetto or chrome://tracing); rank 0
says so in one console line as the window closes. What the profiler's C++ half (kineto) prints
as it starts and stops goes to `profiler-rank<R>.log` there, not to the console. Nothing of it
runs outside the window: a run without the option never imports the profiler. A profile that
cannot be written is a warning, never the end of the run it watches.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from bertforge.training.metrics import console

# Kernel name keywords (lower case) per category; the first category with a keyword in the
# name wins. Attention comes before gemm because fused attention kernels carry `cutlass` or
# `sm90_` in their names (flash's template arguments are cutlass types; the memory-efficient
# kernels are `fmha_cutlassF/B`).
CATEGORIES = (
    ("attention", ("fmha", "flash", "attention", "efficient", "softmax")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "ampere_")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lamb")),
    ("norm", ("layer_norm", "layernorm", "norm")),
    ("dropout/rand", ("dropout", "philox", "bernoulli", "rand")),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "to_copy", "fill")),
    ("reduce", ("reduce", "sum", "nccl")),
)
OTHER = "other elementwise"
CATEGORY_NAMES = tuple(name for name, _ in CATEGORIES) + (OTHER,)

# What makes the host wait for the device. On a GPU: the CUDA runtime calls that block
# (`.item()` and `.tolist()` of a device tensor end in a cudaStreamSynchronize; a copy from
# pageable memory blocks inside cudaMemcpyAsync itself, which `training.device.to_device`
# avoids by pinning). On a CPU nothing waits, but the same code would on a GPU: there a value
# read back by Python, `.item()` called outside any operator, is counted (reads inside an
# operator's CPU kernel, such as fused AdamW's step counts, or `_assert_async`, stay on the
# device on a GPU).
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize",
                        "cudaEventSynchronize", "cudaMemcpy"})
READ_BACK = "aten::item"
STEP_RANGE = "bertforge step "  # the record_function name of a profiled step, + its number
PROFILE_DIR = "profile"  # RUN_DIR/profile/: a run's, moved aside with it (checkpoint.move_aside)


def kernel_category(kernel: str) -> str:
    # Without the C++ lambdas that name ATen's elementwise kernels (`GeluBackwardCUDAKernelImpl(
    # ...)::{lambda()#2}`), whose "lamb" the optimizer's keywords would take: every profile
    # before 2026-11-27 counted GELU, dropout scaling and copies as optimizer time.
    name = kernel.lower().replace("lambda", "")
    for category, keys in CATEGORIES:
        if any(key in name for key in keys):
            return category
    return OTHER


def device_kernels(events: Iterable[Any]) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel run on a CUDA device among profiler `events`
    (memcpy and memset activities included, as the first profiles counted them).

    Ranges (`record_function`, the optimizer's `Optimizer.step#...`) are mirrored on the GPU's
    timeline as user annotations spanning many kernels: counting them as kernels would count
    their kernels twice (the optimizer's 4 ms range did, in the first H200 profile)."""
    kernels = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(event, "is_user_annotation", False):
            continue
        time_range = getattr(event, "time_range", None)
        us = time_range.elapsed_us() if time_range is not None else event.self_device_time_total
        kernels.append((event.name, us))
    return kernels


class StepProfiler:
    """Profiles optimizer steps `steps[0]..steps[1]` (inclusive) of this process, if given.

    The loop calls `begin(step)` before running `step` and `end(step)` once it is done (its
    log line, validation and checkpoint included); a run that resumes inside the window
    profiles what is left of it, one that stops inside it writes what it profiled.
    """

    def __init__(self, steps: tuple[int, int] | None, run_dir: str, rank: int,
                 device: torch.device) -> None:
        self.steps = steps
        self.out_dir = os.path.join(run_dir, PROFILE_DIR)
        self.rank = rank
        self.cuda = torch.device(device).type == "cuda"
        self._profiler = None
        self._step_range = None
        self._started = 0.0
        self._profiled: list[int] = []
        self.summary: dict[str, Any] | None = None  # once written, and where
        self.summary_path: str | None = None

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type: Any, *exc_info: Any) -> None:
        if exc_type is None:
            self.close()
        elif self._profiler is not None:  # the run failed: stop, write nothing, raise its error
            if self._step_range is not None:
                self._step_range.__exit__(None, None, None)
                self._step_range = None
            profiler, self._profiler = self._profiler, None
            with without_cycle_warning():
                profiler.__exit__(None, None, None)

    def begin(self, step: int) -> None:
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return
        if self._profiler is None:
            self._start()
        self._step_range = torch.profiler.record_function(f"{STEP_RANGE}{step}")
        self._step_range.__enter__()
        self._profiled.append(step)

    def end(self, step: int) -> None:
        if self._step_range is None:
            return
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        if step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Stop and write, if a window is open (the loop ended inside it)."""
        if self._profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()  # the window's queued kernels belong to it
        wall_s = time.perf_counter() - self._started
        profiler, self._profiler = self._profiler, None
        with without_cycle_warning(), self._native_output():
            profiler.__exit__(None, None, None)
        try:
            self.summary = summarize(profiler.events(), self._profiled, wall_s, cuda=self.cuda)
            self._write(profiler)
        except Exception as error:  # a diagnostic: the run it watches goes on
            self.summary = None
            if self.rank == 0:
                console(f"[train] WARNING: the profile of steps {self._profiled[0]}-"
                        f"{self._profiled[-1]} was not written ({type(error).__name__}: "
                        f"{error}); training goes on")
            return
        if self.rank == 0:
            console(summary_line(self.summary, self.summary_path))

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profile(activities=activities)
        if self.cuda:
            torch.cuda.synchronize()  # no earlier step's kernels in the window
        with without_cycle_warning(), self._native_output():
            self._profiler.__enter__()
        self._started = time.perf_counter()

    def _native_output(self):
        return native_output_to(os.path.join(self.out_dir, f"profiler-rank{self.rank}.log"))

    def _write(self, profiler) -> None:
        first, last = self._profiled[0], self._profiled[-1]
        stem = f"steps-{first}-{last}-rank{self.rank}"
        os.makedirs(self.out_dir, exist_ok=True)
        self.summary_path = os.path.join(self.out_dir, f"{stem}.json")
        with open(self.summary_path, "w", encoding="utf-8") as f:
            json.dump(self.summary, f, indent=2)
        # ".gz": torch writes it gzipped (BERT-large's 12 steps: ~10^5 events).
        profiler.export_chrome_trace(os.path.join(self.out_dir, f"trace-{stem}.json.gz"))


@contextlib.contextmanager
def native_output_to(path: str) -> Iterator[None]:
    """The process's stdout and stderr descriptors into `path` (appended) for the block.

    kineto writes to them from C++ as a profiler starts and stops ("ERROR: External init
    callback must run in same thread as registerClient" when the profiling thread is not the
    one that imported torch, as in a Ray Train worker; "USDT: ... profiler_start"): no Python
    stream sees those writes, so the worker's console filter cannot keep them in its log, and
    Ray forwarded them to the driver's console. KINETO_LOG_LEVEL silences the second, not the
    first. Python's streams are flushed first, so nothing of theirs lands in the file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = [os.dup(fd) for fd in (1, 2)]
    try:
        for fd in (1, 2):
            os.dup2(target, fd)
        yield
    finally:
        for fd, original in zip((1, 2), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)
        os.close(target)


@contextlib.contextmanager
def without_cycle_warning() -> Iterator[None]:
    """torch (2.11 on the H200) warns onto the run's console that a profiler "clears events at
    the end of each cycle": a profiler without a schedule (this window, gpu_profile.py's
    steps) has one cycle, nothing is cleared."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        yield


def summarize(events: Iterable[Any], steps: list[int], wall_s: float, *,
              cuda: bool) -> dict[str, Any]:
    """The window's numbers from its profiler `events` (see the module docstring)."""
    events = list(events)
    ranges = {}  # step: (start us, end us) of its host range
    for event in events:
        on_host = event.device_type != torch.autograd.DeviceType.CUDA
        if event.name.startswith(STEP_RANGE) and on_host:
            ranges[int(event.name[len(STEP_RANGE):])] = (event.time_range.start,
                                                         event.time_range.end)
    syncs = dict.fromkeys(ranges, 0)
    for event in events:
        if _makes_host_wait(event, cuda):
            start = event.time_range.start
            for step, (begin, end) in ranges.items():
                if begin <= start <= end:
                    syncs[step] += 1
    kernels = device_kernels(events)
    n = max(len(steps), 1)
    by_category = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for name, us in kernels:
        by_category[kernel_category(name)] += us
    kernel_ms = sum(by_category.values()) / 1e3 / n
    wall_ms = 1e3 * wall_s / n
    return {
        "steps": [steps[0], steps[-1]] if steps else [],
        "wall_ms_per_step": wall_ms,
        "per_step": [{"step": s, "host_ms": (ranges[s][1] - ranges[s][0]) / 1e3,
                      "host_syncs": syncs[s]} for s in sorted(ranges)],
        "steps_with_host_syncs": sorted(s for s, count in syncs.items() if count),
        "kernels_per_step": len(kernels) / n if cuda else None,
        "kernel_ms_per_step": kernel_ms if cuda else None,
        # The profiler's own overhead is in the wall time: a lower bound.
        "gpu_busy": kernel_ms / wall_ms if cuda and wall_ms else None,
        "category_ms_per_step": ({c: us / 1e3 / n for c, us in by_category.items()}
                                 if cuda else None),
    }


def _makes_host_wait(event: Any, cuda: bool) -> bool:
    if cuda:
        return event.name in SYNC_CALLS
    parent = event.cpu_parent
    return event.name == READ_BACK and (parent is None or not parent.name.startswith("aten::"))


def summary_line(summary: dict[str, Any], path: str) -> str:
    """One console line: what a user looks at first."""
    first, last = summary["steps"]
    synced = summary["steps_with_host_syncs"]
    gpu = ("" if summary["gpu_busy"] is None else
           f", GPU busy {100 * summary['gpu_busy']:.0f} %, "
           f"{summary['kernels_per_step']:,.0f} kernels a step")
    return (f"[train] profiled steps {first}-{last}: {summary['wall_ms_per_step']:.1f} ms a "
            f"step{gpu}; host syncs in {len(synced)} of {len(summary['per_step'])} steps"
            f"{' (' + ', '.join(map(str, synced)) + ')' if synced else ''}; {path}")
