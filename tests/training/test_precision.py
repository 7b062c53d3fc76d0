"""precision="auto": bf16 only where the device computes it natively; the choice is recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertforge.training import checkpoint
from bertforge.training import precision as precision_lib
from bertforge.training.config import TrainConfig
from bertforge.training.loop import train
from bertforge.training.precision import (
    cpu_native_bf16,
    resolve_precision,
    slow_precision_warning,
)
from bertforge.training.resolved_engine import resolve_engine
from tests.training.conftest import write_dataset
from tests.training.test_loop import config

SAPPHIRE_RAPIDS = {"architecture": "x86_64", "avx2": True, "avx512_f": True,
                   "avx512_bf16": True, "amx_tile": True, "amx_bf16": True}
ZEN_2 = {"architecture": "x86_64", "avx2": True, "avx512_f": False, "avx512_bf16": False,
         "amx_bf16": False}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_dataset(str(root), {"train": [70, 60], "validation": [40]}, max_seq_length=64)


def fake_cpu(monkeypatch, capabilities, *, onednn_bf16=True, aten="AVX512"):
    """The three things torch is asked: cpuinfo's flags, oneDNN's bf16 path, ATen's level."""
    monkeypatch.delenv(precision_lib.CPU_BF16_OVERRIDE, raising=False)  # ask the (fake) CPU
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    monkeypatch.setattr(precision_lib, "_onednn_bf16_enabled", lambda: onednn_bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: aten)


def test_auto_is_bf16_on_a_cpu_with_native_bf16(monkeypatch):
    fake_cpu(monkeypatch, SAPPHIRE_RAPIDS)
    precision, reason = resolve_precision("auto", "cpu")
    assert precision == "bf16" and "avx512_bf16/amx_bf16" in reason
    assert slow_precision_warning("bf16", "cpu") is None


def test_auto_is_fp32_on_an_avx2_cpu_and_explicit_bf16_is_warned_about(monkeypatch):
    fake_cpu(monkeypatch, ZEN_2, onednn_bf16=False, aten="AVX2")
    precision, reason = resolve_precision("auto", "cpu")
    assert precision == "fp32" and "no native bf16" in reason
    assert resolve_precision("bf16", "cpu") == ("bf16", "named explicitly")
    warning = slow_precision_warning("bf16", "cpu")
    assert "will be slow" in warning and "AVX512-BF16" in warning and "fp32" in warning
    assert slow_precision_warning("fp32", "cpu") is None


@pytest.mark.parametrize("onednn_bf16, aten, cap", [
    (False, "AVX512", "ONEDNN_MAX_CPU_ISA"), (True, "AVX2", "ATEN_CPU_CAPABILITY"),
])
def test_a_capped_isa_makes_a_bf16_cpu_count_as_emulating(monkeypatch, onednn_bf16, aten, cap):
    """ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY below AVX-512: torch's kernels emulate bf16
    even on silicon that has it, so auto must not choose it."""
    fake_cpu(monkeypatch, SAPPHIRE_RAPIDS, onednn_bf16=onednn_bf16, aten=aten)
    native, reason = cpu_native_bf16()
    assert not native and cap in reason
    assert resolve_precision("auto", "cpu")[0] == "fp32"


@pytest.mark.parametrize("supported, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_cuda_follows_the_gpu_and_never_picks_fp16(monkeypatch, supported, expected):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation)
                        or supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some GPU")
    precision, reason = resolve_precision("auto", "cuda")
    assert precision == expected and "Some GPU" in reason
    assert asked == [False]  # emulated bf16 (any GPU that can store it) does not count
    assert slow_precision_warning("bf16", "cuda") is None


def test_explicit_precisions_are_kept_and_a_resume_keeps_its_own():
    assert resolve_precision("fp16", "cpu") == ("fp16", "named explicitly")
    assert resolve_precision("fp32", "cuda") == ("fp32", "named explicitly")
    assert resolve_precision("auto", "cpu", saved="bf16")[0] == "bf16"
    assert resolve_precision("fp32", "cpu", saved="bf16")[0] == "fp32"  # the loop refuses it
    assert resolve_precision("auto", "xpu")[0] == "fp32"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("fp8", "cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(data_dir="d", run_dir="r", precision="fp8")
    assert TrainConfig(data_dir="d", run_dir="r").precision == "auto"


def test_the_engine_choice_carries_request_resolution_reason_and_warning(monkeypatch):
    fake_cpu(monkeypatch, ZEN_2, onednn_bf16=False, aten="AVX2")
    resolved = resolve_engine(TrainConfig(data_dir="d", run_dir="r").engine(), 1)
    choice = resolved.precision
    assert resolved.config.precision == "fp32" and choice.requested == "auto"
    assert choice.warning is None
    resolved = resolve_engine(TrainConfig(data_dir="d", run_dir="r", precision="bf16").engine(), 1)
    assert resolved.config.precision == "bf16" and "will be slow" in resolved.precision.warning


def test_the_isa_caps_are_honoured_by_torch_on_this_machine():
    """The cap trick for reproducing an AVX2 CPU on a bigger one: with both variables set,
    torch reports the capped level and auto picks fp32 whatever the silicon."""
    code = ("import torch; from bertforge.training.precision import resolve_precision; "
            "print(torch.backends.cpu.get_cpu_capability(), "
            "resolve_precision('auto', 'cpu')[0])")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    env.pop(precision_lib.CPU_BF16_OVERRIDE, None)  # ask the CPU itself
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["AVX2", "fp32"]


def test_loop_records_the_choice_warns_once_and_resumes_in_the_saved_precision(
    dataset, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(precision_lib, "cpu_native_bf16", lambda: (False, "mocked: emulated"))
    run_dir = tmp_path / "run"
    train(config(dataset, run_dir, precision="bf16", zero_stage=None, max_steps=2))
    out = capsys.readouterr().out
    assert out.count("WARNING: precision bf16 on this CPU will be slow: mocked") == 1
    # The recipe in two lines (ZeRO and the residual stream as resolved), the whole of it in
    # config.json.
    assert (f"ZeRO 0, bf16 residual stream; all of it in {run_dir / 'config.json'}\n"
            "[train] model: ") in out
    assert '"adam_betas"' not in out  # not the 45-line dump of every field
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["precision"]["requested"] == "bf16"
    assert recorded["train"]["precision"] == "bf16"
    assert recorded["train"]["zero_stage"] == 0  # one rank: fp32 weights under autocast

    # "auto" resumes in the checkpoint's precision, whatever the device would choose now.
    train(config(dataset, run_dir, precision="auto", zero_stage=None, max_steps=3))
    assert "[train] precision bf16 (asked: auto): the resumed" in capsys.readouterr().out
    metadata = checkpoint.read_metadata(checkpoint.latest_checkpoint(str(run_dir)))
    assert (metadata["precision"], metadata["precision_requested"]) == ("bf16", "auto")
    with pytest.raises(ValueError, match="trained in bf16; resuming it in fp32"):
        train(config(dataset, run_dir, precision="fp32", zero_stage=None, max_steps=4))
    # A bf16 stage-0 checkpoint of an earlier bertforge (bf16 weights, DeepSpeed's optimizer
    # state) is refused in so many words, not with a state-dict error from inside DeepSpeed.
    latest = checkpoint.latest_checkpoint(str(run_dir))
    assert metadata["bf16_weights"] is False
    earlier = {key: value for key, value in metadata.items() if key != "bf16_weights"}
    (Path(latest) / checkpoint.METADATA_NAME).write_text(json.dumps(earlier))
    with pytest.raises(ValueError, match="earlier bertforge, which kept bf16 weights"):
        train(config(dataset, run_dir, precision="auto", zero_stage=None, max_steps=4))

    fresh = tmp_path / "fresh"
    train(config(dataset, fresh, precision="auto", zero_stage=None, max_steps=1, warmup_steps=0))
    recorded = json.loads((fresh / "config.json").read_text())
    assert recorded["precision"] == {"requested": "auto", "resolved": "fp32",
                                     "reason": "mocked: emulated", "warning": None}
    assert recorded["train"]["precision"] == "fp32" and recorded["train"]["zero_stage"] == 0
    assert "WARNING" not in capsys.readouterr().out


@pytest.mark.parametrize("capabilities, stage, engine_keys", [
    (SAPPHIRE_RAPIDS, 0, {"torch_autocast"}), (ZEN_2, 0, set()),
])
def test_the_zero_stage_and_deepspeed_config_follow_the_resolved_precision(
    monkeypatch, capabilities, stage, engine_keys
):
    """On one rank: stage 0 in both; under bf16 with fp32 weights under torch.autocast."""
    from bertforge.training.engine import deepspeed_config

    fake_cpu(monkeypatch, capabilities, onednn_bf16=capabilities is SAPPHIRE_RAPIDS)
    resolved = resolve_engine(TrainConfig(data_dir="d", run_dir="r").engine(), 1)
    assert resolved.config.zero_stage == stage
    ds = deepspeed_config(resolved)
    assert ds["zero_optimization"]["stage"] == stage
    assert engine_keys == {"bf16", "data_types", "torch_autocast"} & set(ds)


def test_the_override_answers_for_the_cpu_and_auto_then_trains_in_bf16(
    dataset, tmp_path, monkeypatch
):
    """The branch a Zen 4 or Sapphire Rapids machine takes, taken on any machine: auto with a
    CPU that says native bf16 trains in bf16 (emulated here, so two steps only)."""
    monkeypatch.setenv(precision_lib.CPU_BF16_OVERRIDE, "native")
    assert resolve_precision("auto", "cpu") == ("bf16", "BERTFORGE_CPU_BF16=native says so")
    assert slow_precision_warning("bf16", "cpu") is None
    run_dir = tmp_path / "native"
    train(config(dataset, run_dir, precision="auto", zero_stage=None, max_steps=2))
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["precision"]["resolved"] == "bf16"
    assert recorded["train"]["precision"] == "bf16" and recorded["train"]["zero_stage"] == 0

    monkeypatch.setenv(precision_lib.CPU_BF16_OVERRIDE, "emulated")
    assert resolve_precision("auto", "cpu")[0] == "fp32"
    monkeypatch.setenv(precision_lib.CPU_BF16_OVERRIDE, "yes")
    with pytest.raises(ValueError, match="BERTFORGE_CPU_BF16 must be one of"):
        resolve_precision("auto", "cpu")
