"""training.resolved_engine: the machine-dependent settings decided once, and nothing undecided
reaches the engine (issue 35, "resolve once")."""

from __future__ import annotations

import ast
import dataclasses
import json
import os

import pytest

from bertforge.training import loop, resolved_engine
from bertforge.training.engine import build_engine, deepspeed_config, ensure_process_group
from bertforge.training.engine_config import EngineConfig
from bertforge.training.model import BertConfig, BertForPreTraining
from bertforge.training.recipes import micro_batch_for_device
from bertforge.training.resolved_engine import (
    DECIDED,
    PrecisionChoice,
    ResolvedEngine,
    resolve_engine,
)

TRAINING = os.path.join(os.path.dirname(__file__), "..", "..", "training")
UNDECIDED = EngineConfig(max_steps=10, learning_rate=1e-3, warmup_steps=0, micro_batch_size=None)


def test_an_unresolved_config_cannot_reach_the_engine():
    ensure_process_group()
    model = BertForPreTraining(BertConfig(64, 32, 1, 2, 64))
    decided_but_bare = dataclasses.replace(UNDECIDED, precision="fp32", zero_stage=0,
                                           compile=False, micro_batch_size=4)
    for cfg in (UNDECIDED, decided_but_bare):  # a bare EngineConfig, decided or not
        with pytest.raises(TypeError, match="build_engine takes a ResolvedEngine"):
            build_engine(model, cfg)
        with pytest.raises(TypeError, match="deepspeed_config takes a ResolvedEngine"):
            deepspeed_config(cfg)
    # Nor one decided for another number of ranks than the process group's.
    with pytest.raises(ValueError, match="resolved for 2 ranks, the process group has 1"):
        build_engine(model, resolve_engine(decided_but_bare, 2))


def test_a_record_with_anything_undecided_cannot_be_made():
    choice = PrecisionChoice("auto", "fp32", "named", None)
    with pytest.raises(ValueError, match="precision, zero_stage, compile, micro_batch_size, "
                                         "bf16_residual undecided"):
        ResolvedEngine(UNDECIDED, 1, choice)
    only_compile = dataclasses.replace(UNDECIDED, precision="fp32", zero_stage=0,
                                       micro_batch_size=4, bf16_residual=False)
    with pytest.raises(ValueError, match="the engine's compile undecided"):
        ResolvedEngine(only_compile, 1, choice)
    decided = dataclasses.replace(only_compile, compile=False)
    with pytest.raises(ValueError, match="bf16_residual needs the engine's bf16 autocast"):
        ResolvedEngine(dataclasses.replace(decided, bf16_residual=True), 1, choice)
    with pytest.raises(ValueError, match="precision fp32 in the config but bf16"):
        ResolvedEngine(decided, 1, PrecisionChoice("auto", "bf16", "named", None))
    with pytest.raises(ValueError, match="global_batch_size 64 is not a multiple"):
        ResolvedEngine(dataclasses.replace(decided, global_batch_size=64), 3, choice)


def test_resolution_decides_every_setting_once_and_the_record_is_frozen():
    resolved = resolve_engine(UNDECIDED, 1, max_seq_length=128)
    assert all(getattr(resolved.config, name) not in (None, "auto") for name in DECIDED)
    # On a CPU: nothing compiled, the micro-batch of the device rule, ZeRO 0 on one rank.
    assert resolved.config.compile is False and resolved.config.zero_stage == 0
    assert resolved.config.micro_batch_size == micro_batch_for_device(
        128, world_size=1, global_batch_size=None, device_memory_bytes=None)
    assert resolved.precision.requested == "auto"
    assert resolved.precision.resolved == resolved.config.precision
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.config = UNDECIDED
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.config.precision = "auto"
    with pytest.raises(ValueError, match="micro_batch_size is left to the device"):
        resolve_engine(UNDECIDED, 1)  # no sequence length to choose it for


def test_a_resumed_run_keeps_its_precision_and_stage_and_named_ones_win(monkeypatch):
    monkeypatch.setenv("BERTFORGE_CPU_BF16", "native")  # auto alone would pick bf16
    saved = {"precision": "fp32", "zero_stage": 2}
    resolved = resolve_engine(dataclasses.replace(UNDECIDED, micro_batch_size=4), 1, saved=saved)
    assert (resolved.config.precision, resolved.config.zero_stage) == ("fp32", 2)
    named = dataclasses.replace(UNDECIDED, micro_batch_size=4, precision="bf16", zero_stage=1)
    resolved = resolve_engine(named, 4, saved=saved)
    assert (resolved.config.precision, resolved.config.zero_stage) == ("bf16", 1)


def test_the_default_stage_follows_the_decided_precision(monkeypatch):
    """1B parameters on 8 GPUs at stage 1: 9.5 GB of model states a GPU in bf16, 9.0 in fp32.
    With 9.25 GB allowed (half of 18.5 GB), bf16 needs stage 2 and fp32 does not; "auto" that
    keeps a checkpoint's fp32 (one saved before stages were recorded) takes fp32's stage."""
    monkeypatch.setenv("BERTFORGE_CPU_BF16", "native")
    monkeypatch.setattr(resolved_engine, "device_memory_bytes", lambda: 18.5e9)

    def stage(saved=None, **named):
        cfg = dataclasses.replace(UNDECIDED, micro_batch_size=4, **named)
        return resolve_engine(cfg, 8, saved=saved, num_parameters=10**9).config.zero_stage

    assert stage() == stage(precision="bf16") == 2
    assert stage(precision="fp32") == 1
    assert stage(saved={"precision": "fp32"}) == 1


def test_the_residual_stream_is_bf16_wherever_the_engine_trains_under_bf16_autocast(monkeypatch):
    """bf16 at ZeRO 0 (fp32 weights under autocast) hands a bf16 stream between the layers;
    fp32, and DeepSpeed's bf16 model at ZeRO >= 1, keep theirs. Named, off wins; on where it
    would change nothing is refused. The engine sets it on every LayerNorm of the model."""
    monkeypatch.setenv("BERTFORGE_CPU_BF16", "native")  # auto: bf16 on any CPU
    cfg = dataclasses.replace(UNDECIDED, micro_batch_size=4, compile=False)

    def stream(**named):
        return resolve_engine(dataclasses.replace(cfg, **named), 1).config.bf16_residual

    assert stream() is stream(precision="bf16") is True
    assert stream(precision="fp32") is stream(zero_stage=2) is stream(bf16_residual=False) is False
    # Where it would change nothing: refused by the config, named (before any worker starts)
    # or decided (auto giving fp32 here).
    with pytest.raises(ValueError, match="bf16_residual needs the engine's bf16 autocast .*"
                                         "not precision fp32"):
        stream(precision="fp32", bf16_residual=True)
    with pytest.raises(ValueError, match="bf16_residual needs the engine's bf16 autocast .*"
                                         "not precision auto at ZeRO stage 1"):
        stream(zero_stage=1, bf16_residual=True)
    with monkeypatch.context() as fp32_cpu:
        fp32_cpu.setenv("BERTFORGE_CPU_BF16", "emulated")
        with pytest.raises(ValueError, match="bf16_residual needs the engine's bf16 autocast .*"
                                             "not precision fp32 at ZeRO stage 0"):
            stream(bf16_residual=True)
    ensure_process_group()
    for named, expected in (({}, True), ({"precision": "fp32"}, False)):
        model = BertForPreTraining(BertConfig(64, 32, 1, 2, 64))
        model.residual_in_autocast_dtype = not expected  # the engine sets it either way
        engine = build_engine(model, resolve_engine(dataclasses.replace(cfg, **named), 1))
        assert model.residual_in_autocast_dtype is expected
        engine.destroy()


def test_a_resumed_run_keeps_its_residual_stream(monkeypatch):
    """The stream changes the numbers, so a resume keeps its checkpoint's: one saved before
    the setting existed trained with the fp32 stream and keeps it; a named one wins."""
    monkeypatch.setenv("BERTFORGE_CPU_BF16", "native")
    cfg = dataclasses.replace(UNDECIDED, micro_batch_size=4, compile=False)
    before = {"precision": "bf16", "zero_stage": 0}

    def stream(saved, **named):
        cfg_named = dataclasses.replace(cfg, **named)
        return resolve_engine(cfg_named, 1, saved=saved).config.bf16_residual

    assert stream(before) is False
    assert stream({**before, "bf16_residual": True}) is True
    assert stream({**before, "bf16_residual": False}) is False
    assert stream(before, bf16_residual=True) is True
    # At ZeRO 2 (DeepSpeed's bf16 model) there is no stream to keep.
    assert stream({"precision": "bf16", "zero_stage": 2, "bf16_residual": True}) is False


def _callers(functions: set[str]) -> dict[str, set[str]]:
    """The modules of training/ and cluster/ that call any of `functions`, and which."""
    callers: dict[str, set[str]] = {}
    root = os.path.normpath(os.path.join(TRAINING, ".."))
    for folder in ("training", "cluster"):
        for path, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                file = os.path.join(path, name)
                tree = ast.parse(open(file, encoding="utf-8").read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call):
                        called = getattr(node.func, "id", getattr(node.func, "attr", None))
                        if called in functions:
                            callers.setdefault(os.path.relpath(file, root), set()).add(called)
    return callers


def test_the_decisions_are_made_in_one_module_only():
    """Pretraining and fine-tuning decide through resolve_engine: no other module of training/
    (or cluster/) calls the deciding functions itself; and the decided residual stream reaches
    the model in one place, the engine's build (the model's own property aside), as do FP8
    GEMMs."""
    deciders = {"resolve_precision", "default_zero_stage", "micro_batch_for_device"}
    assert _callers(deciders) == {os.path.join("training", "resolved_engine.py"): deciders}
    stream = {"set_residual_in_autocast_dtype"}
    assert _callers(stream) == {os.path.join("training", "engine.py"): stream,
                                os.path.join("training", "model.py"): stream}
    assert _callers({"set_fp8"}) == {os.path.join("training", "engine.py"): {"set_fp8"}}


def test_the_loop_records_the_settings_it_decided_and_trained_with(tmp_path):
    """Pretraining resolves once, and what `bertforge train` records (config.json) is the
    record its engine was built from, everything left open decided."""
    from bertforge.training.loop import train
    from tests.training.conftest import write_dataset
    from tests.training.test_loop import config

    # The CPU's micro-batch at 64 tokens is 128 sequences: one step's worth of rows.
    data = write_dataset(str(tmp_path / "data"), {"train": [140]}, max_seq_length=64)
    cfg = config(data, tmp_path / "run", max_steps=1, warmup_steps=0, precision="auto",
                 compile=None, zero_stage=None, micro_batch_size=None)
    engines = []
    real_build = loop.build_engine
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "build_engine",
                      lambda model, resolved, **kw: engines.append(resolved)
                      or real_build(model, resolved, **kw))
        train(cfg)
    [resolved] = engines
    with open(tmp_path / "run" / "config.json", encoding="utf-8") as f:
        recorded = json.load(f)["train"]
    assert {name: recorded[name] for name in DECIDED} == {
        name: getattr(resolved.config, name) for name in DECIDED}
    assert recorded["micro_batch_size"] == micro_batch_for_device(
        64, world_size=1, global_batch_size=None, device_memory_bytes=None)
    assert recorded["compile"] is False and recorded["zero_stage"] == 0
    # Each checkpoint records what a resume keeps: the stage, precision and residual stream.
    from bertforge.training import checkpoint

    saved = checkpoint.read_metadata(checkpoint.latest_checkpoint(str(tmp_path / "run")))
    assert {name: saved[name] for name in ("zero_stage", "precision", "bf16_residual")} == {
        name: getattr(resolved.config, name) for name in ("zero_stage", "precision",
                                                          "bf16_residual")}
