"""benchmarks/gpu_profile.py end to end on the CPU (tiny model): the defaults beside FP8 GEMMs
and the peer; a compile the size estimates break."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.alone import alone_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_profile.py")


# gpu_profile.main in a fresh interpreter with its `run_case` wrapped: {wrapper} defines
# `run_case(step, args, copy_gbps=None)` around `real_run_case`, and {after} runs last.
WRAPPED = """
import sys
sys.argv[0] = {script!r}
sys.path.insert(0, {benchmarks!r})
import gpu_profile, kernel_bandwidth

real_run_case = gpu_profile.run_case
{wrapper}
gpu_profile.run_case = run_case
report = gpu_profile.main({argv!r})
{after}
"""


def profile_wrapped(tmp_path, cases: str, wrapper: str, after: str, *more: str):
    argv = ["--device", "cpu", "--config", "tiny", "--cases", cases, *more, "--warmup", "1",
            "--timed", "1", "--profiled", "1", "--num-batches", "2",
            "--out", str(tmp_path / "profile.md")]
    code = WRAPPED.format(script=SCRIPT, benchmarks=os.path.dirname(SCRIPT), argv=argv,
                          wrapper=wrapper, after=after)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                          env={**alone_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


BROKEN_BY_ESTIMATES = """
from torch._inductor.exc import InductorError
failed = []

def run_case(step, args, copy_gbps=None):
    if kernel_bandwidth.estimates_enabled():  # as a compile broken by the estimates would
        failed.append(True)
        raise InductorError(RuntimeError("broken by benchmark_kernel"), None)
    return real_run_case(step, args, copy_gbps)
"""


def test_a_compile_the_size_estimates_break_is_profiled_again_without_them(tmp_path):
    """The bandwidth section comes from a debugging switch of inductor's (`benchmark_kernel`);
    if it ever broke a compile on the GPU, the case runs again without it rather than the
    profile stage losing its cases."""
    out = profile_wrapped(
        tmp_path, "ours32x4,fp832x4", BROKEN_BY_ESTIMATES,
        "assert failed == [True] and not kernel_bandwidth.estimates_enabled()\n"
        "print('cases', [r['case'] for r in report['results']])",
        "--engine-args=--precision=bf16")
    assert "cases ['ours32x4', 'fp832x4']" in out
    assert ("ours32x4: the compile failed with inductor's size estimates on (InductorError); "
            "again without them") in out


RECORDING_ESTIMATES = """
estimates = []

def run_case(step, args, copy_gbps=None):
    estimates.append(kernel_bandwidth.estimates_enabled())
    return real_run_case(step, args, copy_gbps)
"""


def test_the_fp8_case_is_the_defaults_with_fp8_gemms_and_the_peer_has_no_estimates(tmp_path):
    """gpu_check.sh profiles `ours128x256,hfc128x256` on the GPU, and `fp8128x256` as an
    experiment: the `fp8` case must be our engine with the same settings and FP8 turned on, so
    that its rows say where FP8's casts spend their time and nothing else. bf16 named (FP8
    needs autocast; "auto" gives fp32 on an AVX2 machine); on a CPU only wall times come back.
    inductor's size estimates are part of its cache key: the peer's case runs without them, so
    that on the GPU its compile finds the one gpu_throughput.py's peer left in the cache (65 s
    on the H200 without it), and our cases, before or after it, run with them."""
    said = profile_wrapped(tmp_path, "ours32x4,hf32x4,fp832x4", RECORDING_ESTIMATES,
                           "print('estimates', estimates)", "--engine-args=--precision=bf16")
    assert "estimates [True, False, True]" in said
    out = tmp_path / "profile.md"
    ours, peer, fp8 = json.loads(out.with_suffix(".json").read_text())["results"]
    assert peer["kind"] == "hf"
    assert (ours["kind"], fp8["kind"]) == ("ours", "fp8")
    assert (ours["settings"]["fp8"], fp8["settings"]["fp8"]) == (False, True)
    same = ("zero_stage", "precision", "compile", "bf16_residual", "optimizer")
    assert {k: ours["settings"][k] for k in same} == {k: fp8["settings"][k] for k in same}
    assert fp8["settings"]["precision"] == "bf16"
    # The same batches and seed: only FP8's own rounding parts the two losses.
    assert ours["loss_last_timed"] != fp8["loss_last_timed"]
    assert abs(ours["loss_last_timed"] - fp8["loss_last_timed"]) < 0.05
    assert "## fp832x4: our engine, gpu_throughput.py's settings with --fp8" in out.read_text()
    # No GPU: no Triton kernel to put against a copy, and the report says so.
    assert ours["bandwidth"]["copy_gbps"] is None
    assert ours["bandwidth"]["triton_ms_per_step"] == 0
    assert "a device-to-device copy not measured (no GPU)" in out.read_text()
