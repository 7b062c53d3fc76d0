"""`--profile-steps`: a profile of the training loop itself (training.profiling; issue 34: the
loop's logging, metrics and checkpoints must not make the host wait for the device)."""

from __future__ import annotations

import gzip
import json
import os
import threading
import warnings

import pytest
import torch

from bertforge.training.config import TrainConfig
from bertforge.training.loop import train
from bertforge.training.profiling import (
    OTHER,
    StepProfiler,
    kernel_category,
    summary_line,
)
from tests.training.test_loop import config


def test_a_profiled_window_of_the_loop_reads_nothing_back_and_is_written(dataset_dir, tmp_path,
                                                                          capsys):
    """Steps 2-5 of a 6-step run logging at 1, 3 and 6 (fast path: ZeRO 0, fp32): no step
    reads a value back from the device, the log step (3) included (its sums come back in one
    `.tolist()`, which on a CPU is no read of a device); the summary and the trace are on disk
    and one console line says where."""
    run_dir = tmp_path / "run"
    train(config(dataset_dir, run_dir, zero_stage=0, precision="fp32", log_every=3,
                 profile_steps=(2, 5)))
    summary_path = run_dir / "profile" / "steps-2-5-rank0.json"
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == [2, 5]
    assert [s["step"] for s in summary["per_step"]] == [2, 3, 4, 5]
    assert summary["steps_with_host_syncs"] == [], summary["per_step"]
    assert all(s["host_ms"] > 0 for s in summary["per_step"])
    assert summary["wall_ms_per_step"] >= max(s["host_ms"] for s in summary["per_step"]) / 4
    assert summary["gpu_busy"] is None and summary["kernels_per_step"] is None  # a CPU run
    with gzip.open(run_dir / "profile" / "trace-steps-2-5-rank0.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"bertforge step 2", "bertforge step 5"} <= names
    out = capsys.readouterr().out
    assert "[train] profiled steps 2-5: " in out and str(summary_path) in out
    assert "host syncs in 0 of 4 steps" in out


def test_a_value_read_back_inside_a_step_is_counted_for_that_step(tmp_path):
    """The measure can fail: `.item()` in step 3 (what a per-step loss log would do) marks
    step 3 and no other. A window that starts before the first step run (a resume inside it)
    profiles what is left; one cut short by the end of the run is written at close."""
    x = torch.randn(64)
    with StepProfiler((1, 9), str(tmp_path), rank=0, device=torch.device("cpu")) as profiler:
        for step in (2, 3, 4):  # resumed at 1, stops at 4
            profiler.begin(step)
            y = (x * step).sum()
            if step == 3:
                y.item()
            profiler.end(step)
    summary = profiler.summary
    assert summary["steps"] == [2, 4]
    assert summary["steps_with_host_syncs"] == [3]
    assert [s["host_syncs"] for s in summary["per_step"]] == [0, 1, 0]
    assert os.path.basename(profiler.summary_path) == "steps-2-4-rank0.json"
    assert "host syncs in 1 of 3 steps (3)" in summary_line(summary, profiler.summary_path)


def test_steps_outside_the_window_are_not_profiled(tmp_path):
    profiler = StepProfiler((5, 6), str(tmp_path), rank=0, device=torch.device("cpu"))
    for step in (1, 2, 3):
        profiler.begin(step)
        profiler.end(step)
    profiler.close()
    assert profiler.summary is None and not (tmp_path / "profile").exists()


@pytest.mark.parametrize("first, last", [(0, 3), (4, 2)])
def test_a_window_out_of_order_is_refused(first, last):
    with pytest.raises(ValueError, match="profile_steps"):
        TrainConfig(data_dir="d", run_dir="r", profile_steps=(first, last))


def test_a_window_after_the_last_step_is_refused():
    """It would profile nothing, without a word."""
    with pytest.raises(ValueError, match=r"profile_steps 50 60 end after the run's last step, 10"):
        TrainConfig(data_dir="d", run_dir="r", max_steps=10, profile_steps=(50, 60))
    TrainConfig(data_dir="d", run_dir="r", max_steps=10, profile_steps=(9, 10))


def test_kernels_fall_in_the_categories_of_their_names():
    assert kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_category("triton_per_fused_add_native_dropout_native_layer_norm") == "norm"
    assert kernel_category("triton_poi_fused_gelu_view_9") == OTHER
    assert kernel_category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel"
                           "<at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata"
                           "<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor") \
        == "optimizer"
    assert kernel_category("lamb_cuda_kernel_part1<float, float>") == "optimizer"


def test_an_elementwise_kernel_named_by_a_lambda_is_not_the_optimizer():
    """ATen names its elementwise kernels by C++ lambdas; "lambda" holds "lamb", an optimizer's
    name (the H200 profile of 2026-11-27 counted 20 ms of GELU and dropout as optimizer)."""
    gelu_backward = ("void at::native::vectorized_elementwise_kernel<8, at::native::"
                     "GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::"
                     "{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::"
                     "{lambda(c10::BFloat16, c10::BFloat16)#1}, std::array<char*, 3ul> >")
    assert kernel_category(gelu_backward) == OTHER
    dropout_scale = ("void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous "
                     "namespace)::masked_scale_kernel<bool, c10::BFloat16, float>(at::Tensor&, "
                     "at::Tensor const&, at::Tensor const&, float)::"
                     "{lambda(c10::BFloat16, bool)#1}")
    assert kernel_category(dropout_scale) == OTHER


def test_the_profilers_cycle_warning_stays_off_the_console(tmp_path, monkeypatch):
    """torch 2.11 (the H200's) warned as the window opened that a profiler "clears events at
    the end of each cycle"; torch on this CPU does not, so the warning is planted where torch
    raises it, in the profiler's start and stop."""
    from torch.profiler import profile

    def warns(method):
        def warning_then(self, *args, **kwargs):
            warnings.warn("Warning: Profiler clears events at the end of each cycle.",
                          stacklevel=2)
            return method(self, *args, **kwargs)
        return warning_then

    monkeypatch.setattr(profile, "start", warns(profile.start))
    monkeypatch.setattr(profile, "stop", warns(profile.stop))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with StepProfiler((1, 2), str(tmp_path), rank=0, device=torch.device("cpu")) as profiler:
            for step in (1, 2, 3):
                profiler.begin(step)
                torch.ones(4).sum()
                profiler.end(step)
    assert profiler.summary is not None  # the window was profiled
    assert [str(w.message) for w in shown] == []


def test_the_profilers_native_lines_go_to_its_log_not_the_console(tmp_path, capfd):
    """kineto prints from C++ onto the process's descriptors as a window opens and closes,
    an "External init callback" error too when the loop runs in a thread other than the one
    that imported torch (a Ray Train worker's): Ray forwarded those lines to the driver's
    console. They now go to the profile's own log."""
    def profile_three_steps():
        with StepProfiler((1, 2), str(tmp_path), rank=0, device=torch.device("cpu")) as profiler:
            for step in (1, 2, 3):
                profiler.begin(step)
                torch.ones(4).sum()
                profiler.end(step)

    worker = threading.Thread(target=profile_three_steps)
    worker.start()
    worker.join()
    native = (tmp_path / "profile" / "profiler-rank0.log").read_text()
    assert "profiler_start" in native and "profiler_stop" in native  # torch 2.11's kineto
    console = capfd.readouterr()
    assert "profiler_st" not in console.out + console.err
    assert "External init callback" not in console.out + console.err
    print("a line after the window")  # the descriptors are the console's again
    assert capfd.readouterr().out == "a line after the window\n"


def test_a_run_that_fails_inside_the_window_stops_the_profiler_and_writes_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="step 3 failed"):
        with StepProfiler((2, 5), str(tmp_path), rank=0, device=torch.device("cpu")) as profiler:
            for step in (1, 2, 3):
                profiler.begin(step)
                if step == 3:
                    raise RuntimeError("step 3 failed")
                profiler.end(step)
    assert profiler.summary is None
    assert sorted(os.listdir(tmp_path / "profile")) == ["profiler-rank0.log"]  # kineto's lines
    # None is left running (torch's own flag: a second profiler would start beside it).
    assert not torch.autograd.profiler._is_profiler_enabled


def test_on_a_gpu_blocking_runtime_calls_count_and_ranges_are_no_kernels():
    """summarize() as it reads a CUDA profile (no GPU here: events as torch 2.11's profiler
    gives them, host ranges and runtime calls on the CPU side, kernels and the ranges' mirrors
    on the device): a cudaStreamSynchronize inside step 8's range marks step 8; launches do
    not; the mirrors of `bertforge step N` and `Optimizer.step#...` are not kernels."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    from bertforge.training.profiling import summarize

    def event(name, start, end, device=DeviceType.CPU, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end),
                               is_user_annotation=annotation, cpu_parent=None)

    events = [
        event("bertforge step 7", 0, 100, annotation=True),
        event("bertforge step 8", 100, 200, annotation=True),
        event("cudaLaunchKernel", 10, 11),
        event("cudaStreamSynchronize", 150, 190),
        event("aten::item", 149, 191),  # on a GPU the runtime call is what counts
        event("bertforge step 7", 5, 120, DeviceType.CUDA, annotation=True),
        event("Optimizer.step#ClippedAdamW.step", 60, 100, DeviceType.CUDA, annotation=True),
        event("nvjet_sm90_tst_256x128_gemm", 20, 80, DeviceType.CUDA),
        event("triton_per_fused_native_layer_norm", 80, 90, DeviceType.CUDA),
        event("multi_tensor_apply_kernel<FusedAdam>", 120, 150, DeviceType.CUDA),
    ]
    summary = summarize(events, [7, 8], wall_s=200e-6, cuda=True)
    assert summary["steps_with_host_syncs"] == [8]
    assert [s["host_syncs"] for s in summary["per_step"]] == [0, 1]
    assert summary["kernels_per_step"] == 1.5  # 3 kernels over 2 steps, no range
    assert summary["kernel_ms_per_step"] == pytest.approx(0.05)
    assert summary["gpu_busy"] == pytest.approx(0.5)
    assert summary["category_ms_per_step"]["gemm"] == pytest.approx(0.03)
    assert summary["category_ms_per_step"]["optimizer"] == pytest.approx(0.015)


def test_a_profile_that_cannot_be_written_is_a_warning_and_the_run_goes_on(
        dataset_dir, tmp_path, capsys, monkeypatch):
    """A diagnostic never ends the run it watches: the summary fails (here: planted), the
    console says so once, and the run trains to its last step and checkpoint."""
    from bertforge.training import profiling

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(profiling, "summarize", broken)
    result = train(config(dataset_dir, tmp_path / "run", zero_stage=0, precision="fp32",
                          log_every=3, profile_steps=(2, 3)))
    assert result.global_step == 6 and os.path.isdir(result.checkpoint_path)
    out = capsys.readouterr().out
    assert "[train] WARNING: the profile of steps 2-3 was not written (OSError: disk full)" in out
    assert "profiled steps" not in out
