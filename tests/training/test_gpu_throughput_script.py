"""benchmarks/gpu_throughput.py end to end on the CPU (tiny model), and its synthetic batches."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bertforge.training.masking import IGNORE_INDEX
from bertforge.training.model import BertConfig, BertForPreTraining, num_parameters
from tests.support.alone import alone_env
from tests.support.synthetic import instance_token_counts, synthetic_batches
from tests.training.conftest import google_layout_vocab, write_dataset

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_throughput.py")


def load_script():
    if "gpu_throughput" in sys.modules:
        return sys.modules["gpu_throughput"]
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


# gpu_throughput.main for each set of flags in one interpreter (a process each took ~4 s of
# imports): what it said on stderr, each set's after a line that names it.
MARK = "=== gpu_throughput with: "
RUNS = """
import sys
sys.argv[0] = {script!r}
sys.path.insert(0, {benchmarks!r})
import gpu_throughput

for flags in {cases!r}:
    print({mark!r} + " ".join(flags), file=sys.stderr, flush=True)
    try:
        gpu_throughput.main({common!r} + flags)
    except BaseException as error:  # SystemExit, or the engine's error as the console shows it
        print(f"refused: {{type(error).__name__}}: {{error}}", file=sys.stderr, flush=True)
"""


def runs_in_one_interpreter(common: list[str], flag_sets: list[list[str]]) -> list[str]:
    """What gpu_throughput.py with `common` + each of `flag_sets` said on stderr, in order."""
    code = RUNS.format(script=SCRIPT, benchmarks=os.path.dirname(SCRIPT), common=common,
                       cases=flag_sets, mark=MARK)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=alone_env(),
                          capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stderr.split(MARK)[1:]
    assert len(said) == len(flag_sets), done.stderr[-3000:]
    for flags, text in zip(flag_sets, said, strict=True):
        assert text.startswith(" ".join(flags)), text[:2000]
    return said


def assert_refused(said: list[str], reasons: list[str]) -> None:
    """Each run stopped, saying its reason."""
    for text, reason in zip(said, reasons, strict=True):
        assert "refused: " in text and reason in text, text


def test_lengths_follow_googles_target_rule():
    counts = instance_token_counts(np.random.default_rng(0), 20_000, 128, short_seq_prob=0.1)
    full = counts == 125  # 128 - [CLS] - 2 x [SEP]
    assert counts.min() >= 2 and counts.max() == 125
    # Short targets are uniform on [2, 125], so ~1/124 of them land on 125 too.
    assert abs((~full).mean() - 0.1 * 123 / 124) < 0.01


def test_synthetic_batches_are_loader_shaped_and_masked_like_google():
    batches = synthetic_batches(3, 64, 128, 1000, seed=1)
    for batch in batches:
        assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels",
                              "next_sentence_label"}
        lengths = batch["attention_mask"].sum(dim=1).numpy()
        assert batch["input_ids"].shape[1] % 8 == 0 and lengths.max() <= 128
        labelled = (batch["labels"] != IGNORE_INDEX).sum(dim=1).numpy()
        expected = np.minimum(20, np.maximum(1, np.rint(lengths * 0.15)))
        np.testing.assert_array_equal(labelled, expected)
    assert not torch.equal(batches[0]["input_ids"], batches[1]["input_ids"])  # distinct


def test_flop_counts_match_the_design_figure_and_padding_is_not_needed_work():
    script = load_script()
    config = BertConfig.preset("large")
    full = synthetic_batches(1, 8, 128, config.vocab_size, short_seq_prob=0.0)[0]
    counts = script.batch_counts(full, config)
    assert counts["flops_needed"] == counts["flops_computed"]  # same length, same labels
    per_token = counts["flops_needed"] / counts["real_tokens"] / 1e9
    # DESIGN.md, "Field facts": ~1.85 GFLOP per token at 128, 20 predictions.
    assert 1.8 < per_token < 1.9
    mixed = synthetic_batches(1, 64, 128, config.vocab_size, short_seq_prob=0.5)[0]
    counts = script.batch_counts(mixed, config)
    assert counts["real_tokens"] < counts["padded_tokens"]
    assert counts["flops_needed"] < counts["flops_computed"]


def test_real_shards_give_the_batches_and_the_length(tmp_path):
    script = load_script()
    data_dir = write_dataset(str(tmp_path / "shards"), max_seq_length=64)
    args = script.parse_args(["--data", data_dir, "--micro-batch", "8", "--num-batches", "12"])
    [case] = script.plan_cases(args)
    assert (case.seq_len, case.micro_batch, case.data_dir) == (64, 8, data_dir)
    batches, vocab_size, data = script.make_batches(case, args, rank=0, world_size=1)
    assert len(batches) == 12  # 70 rows make 8 batches an epoch: the rest from epoch 1
    assert vocab_size == len(google_layout_vocab()) and data_dir in data
    assert all(b["input_ids"].shape[0] == 8 and b["input_ids"].shape[1] <= 64 for b in batches)


def test_peak_lookup_by_device_name():
    script = load_script()
    args = script.parse_args([])
    assert script.peak_tflops(args, "NVIDIA H100 80GB HBM3")[0] == 989.0
    assert script.peak_tflops(args, "NVIDIA H100 PCIe")[0] == 756.0
    assert script.peak_tflops(args, "NVIDIA H200")[0] == 989.0
    assert script.peak_tflops(args, "NVIDIA A100-SXM4-80GB")[0] == 312.0
    with pytest.raises(SystemExit):
        script.peak_tflops(args, "NVIDIA GeForce RTX 4090")
    args = script.parse_args(["--peak-tflops", "123"])
    assert script.peak_tflops(args, "anything") == (123.0, "--peak-tflops")


def test_script_runs_on_cpu_and_writes_results(tmp_path):
    peak = 0.5
    command = [
        sys.executable, SCRIPT, "--device", "cpu", "--config", "tiny", "--seq-lens", "64,128",
        "--micro-batch", "4", "--steps", "2", "--warmup", "1", "--num-batches", "2",
        "--peak-tflops", str(peak), "--output-dir", str(tmp_path), "--tag", "smoke",
    ]
    done = subprocess.run(command, cwd=REPO, env=alone_env(), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [json_file] = list(tmp_path.glob("gpu_throughput_cpu-*_smoke.json"))
    [md_file] = list(tmp_path.glob("gpu_throughput_cpu-*_smoke.md"))
    report = json.loads(json_file.read_text())
    assert report["environment"]["date"] in json_file.name
    # The project's defaults (none given): on one worker ZeRO 0, bf16 through torch.autocast;
    # on a CPU no compile, and no peer rows (the peer runs on a GPU by default).
    assert report["peak_tflops"] == peak and report["setup"]["zero_stage"] is None
    assert "peer" not in report
    assert report["setup"]["precision"] == "bf16" and report["matmul_reference"]["tflops"] > 0
    assert [r["seq_len"] for r in report["results"]] == [64, 128]
    for result in report["results"]:
        assert result["micro_batch"] == 4 and result["sequences"] == 2 * 4
        assert result["deepspeed_config"]["zero_optimization"]["stage"] == 0
        assert result["deepspeed_config"]["torch_autocast"]["enabled"] is True
        assert (result["zero_stage"], result["compile"], result["precision"]) == (0, False, "bf16")
        assert result["real_tokens_per_s"] > 0
        assert result["padded_tokens_per_s"] >= result["real_tokens_per_s"]
        assert result["sequences_per_s"] > 0 and result["step_ms_median"] > 0
        assert np.isfinite(result["loss_last"])
        assert result["mfu_needed"] == pytest.approx(result["tflops_needed"] / peak)
        assert result["mfu_computed"] == pytest.approx(result["tflops_computed"] / peak)
        assert 0 < result["tflops_needed"] <= result["tflops_computed"]
        assert isinstance(result["full_collections"], int) and result["collection_ms"] >= 0
    assert "| seq len | micro batch |" in md_file.read_text()
    assert "Python's garbage collection inside the timed steps" in md_file.read_text()
    assert "| 128 | 4 |" in done.stdout


def test_the_peer_rows_sit_beside_ours_with_the_ratio():
    script = load_script()
    ours = {"seq_len": 128, "micro_batch": 256, "step_ms_median": 100.0,
            "sequences_per_s": 2560.0, "peak_memory_gib": 30.0}
    peer = {"seq_len": 128, "micro_batch": 256, "step_ms_median": 200.0, "compile": True,
            "sequences_per_s": 1280.0, "peak_memory_gib": 40.0, "warmup_s": 61.0}
    other_length = {**peer, "seq_len": 512, "micro_batch": 64}
    lines = script.peer_section({"results": [ours], "peer": [peer, other_length]})
    rows = [line for line in lines if line.startswith("| 128 |")]
    assert len(rows) == 2 and "transformers + torch.compile" in rows[1]
    assert "**2.00**" in rows[1] and "| 61 |" in rows[1]
    assert script.peer_section({"results": [ours]}) == []


def test_variants_sit_in_one_table_beside_the_defaults(tmp_path):
    """gpu_check.sh's "variants" stage: the defaults and four variants (--no-bf16-residual: the
    fp32 residual stream; --gradient-buckets: several ranks' stage-0 reduction on this one;
    --fp8: the encoder's GEMMs in FP8; --no-dropout: what dropout costs, a diagnostic),
    each a gpu_throughput.py run, then benchmarks/ab_table.py's table with the ratio to the
    defaults and the last loss. A setting that would change nothing (CUDA graphs without
    compiled layers, a bf16 residual stream or FP8 without autocast) or is not stage 0's
    reduction is refused, not timed."""
    common = ["--device", "cpu", "--config", "tiny", "--seq-lens", "64", "--micro-batch", "4",
              "--steps", "2", "--warmup", "1", "--num-batches", "2", "--peak-tflops", "1",
              "--output-dir", str(tmp_path)]
    variants = [(["--tag", f"variant-{tag}", *flags]) for tag, flags in (
        ("defaults", []), ("fp32-residual", ["--no-bf16-residual"]),
        ("buckets", ["--gradient-buckets"]), ("fp8", ["--fp8"]), ("no-dropout", ["--no-dropout"]),
        ("packing", ["--packing"]))]
    refusals = [
        (["--compile-mode", "reduce-overhead", "--no-compile"],
         "--compile-mode needs compiled layers"),
        (["--bf16-residual", "--precision", "fp32"],
         "bf16_residual needs the engine's bf16 autocast"),
        (["--fp8", "--zero-stage", "2"], "fp8 needs the engine's bf16 autocast"),
        (["--gradient-buckets", "--zero-stage", "2"], "--gradient-buckets is stage 0's reduction"),
        (["--no-dropout", "--peer"], "--no-dropout is a diagnostic")]
    said = runs_in_one_interpreter(common, variants + [flags for flags, _ in refusals])
    assert not any("refused: " in text for text in said[:len(variants)]), said
    assert_refused(said[len(variants):], [reason for _, reason in refusals])
    runs = sorted(str(p) for p in tmp_path.glob("gpu_throughput_*variant-*.json"))
    table = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "ab_table.py"),
                            *runs], capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and " x 4 |" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| defaults", "| buckets",
                                                      "| fp32-residual", "| fp8",
                                                      "| no-dropout", "| packing"]
    assert "| 1.000x |" in rows[0] and "| 0.0e+00 | 0 |" in rows[0]
    # The reduction over one rank is the identity: the same arithmetic, the same loss.
    assert "| 0.0e+00 | 0 |" in rows[1]
    assert rows[2].endswith(" | 0 |") and "| 0.0e+00 |" not in rows[2]
    assert rows[3].endswith(" | 0 |") and "| 0.0e+00 |" not in rows[3]  # FP8's own arithmetic
    assert "| 0.0e+00 |" not in rows[4]  # no masks: another loss
    results = {run.removesuffix(".json").split("variant-")[1]:
               json.loads(open(run).read())["results"][0] for run in runs}
    # bf16 under autocast (one worker): the bf16 stream is the default, the flag turns it off.
    assert {tag: r["bf16_residual"] for tag, r in results.items()} == {
        "defaults": True, "fp32-residual": False, "buckets": True, "fp8": True,
        "no-dropout": True, "packing": True}
    assert {tag: r["gradient_buckets"] for tag, r in results.items()} == {
        "defaults": False, "fp32-residual": False, "buckets": True, "fp8": False,
        "no-dropout": False, "packing": False}
    assert {tag: r["fp8"] for tag, r in results.items()} == {
        "defaults": False, "fp32-residual": False, "buckets": False, "fp8": True,
        "no-dropout": False, "packing": False}
    assert [tag for tag, r in results.items() if not r["dropout"]] == ["no-dropout"]
    # Packed: the same instances (sequences, real tokens, needed FLOPs); four rows of 64 have
    # too few short ones to save a row (the counts' own test packs 64 rows of 128).
    packed, unpacked = results["packing"], results["defaults"]
    assert [tag for tag, r in results.items() if r["packing"]] == ["packing"]
    for key in ("sequences", "real_tokens", "predictions", "flops_needed"):
        assert packed[key] == unpacked[key], key
    assert "packed up to 3 instances a row" in packed["data"]


def test_a_packed_batch_counts_its_instances_as_the_batch_they_came_from():
    """`--packing`: sequences/s and needed FLOPs are the instances', wherever they sit; the
    computed FLOPs are the packed rows' (fewer padded positions, 3 [CLS] slots a row)."""
    from bertforge.training.data.packing import pack_batch

    gt = load_script()
    config = BertConfig.preset("tiny")
    [batch] = synthetic_batches(1, 64, 128, config.vocab_size, seed=3)
    packed = pack_batch(batch, pad_id=config.pad_token_id, row_length=128, max_per_row=3)
    assert packed["input_ids"].shape[0] < 64  # some rows hold two or three instances
    counts = gt.batch_counts(batch, config, max_predictions=20)
    packed_counts = gt.batch_counts(packed, config, max_predictions=22)
    for key in ("sequences", "real_tokens", "predictions", "flops_needed"):
        assert packed_counts[key] == counts[key], key
    assert packed_counts["padded_tokens"] < counts["padded_tokens"]
    lengths, labels = gt.instance_counts(packed)
    assert sorted(lengths) == sorted(batch["attention_mask"].sum(dim=1).tolist())
    assert sorted(labels) == sorted((batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist())


def test_an_inductor_setting_is_an_experiment_of_its_own_run(tmp_path):
    """`--inductor-config NAME=VALUE`: one of inductor's settings for a variant's run (e.g.
    fallback_random, dropout's masks from ATen's kernels instead of drawn inside the fused
    ones). Same seed and batches: a compiled run's loss moves only if the setting took.
    One encoder layer (`--num-layers`): half the kernels to compile of tiny's two."""
    common = [sys.executable, SCRIPT, "--device", "cpu", "--config", "tiny", "--num-layers", "1",
              "--seq-lens", "64", "--micro-batch", "4", "--steps", "2", "--warmup", "1",
              "--num-batches", "2", "--peak-tflops", "1", "--compile", "--output-dir",
              str(tmp_path)]
    one_layer = dataclasses.replace(BertConfig.preset("tiny"), num_hidden_layers=1)
    parameters = num_parameters(BertForPreTraining(one_layer))
    losses = {}
    for tag, flags in (("defaults", []),
                       ("eager-rng", ["--inductor-config", "fallback_random=True"])):
        done = subprocess.run(common + flags + ["--tag", tag], cwd=REPO, env=alone_env(),
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        [path] = tmp_path.glob(f"gpu_throughput_*_{tag}.json")
        [result] = json.loads(path.read_text())["results"]
        losses[tag] = result["loss_last"]
        assert result["inductor_config"] == ({"fallback_random": True} if flags else {})
        assert result["parameters"] == parameters
    assert losses["eager-rng"] != losses["defaults"]
    table = next(tmp_path.glob("gpu_throughput_*_eager-rng.md")).read_text()
    assert "inductor fallback_random=True (experiment)" in table
    assert "- model: tiny with 1 encoder layer (" in table
    gt = load_script()
    assert gt.inductor_setting("triton.cudagraphs=False") == ("triton.cudagraphs", False)
    refusals = [(["--inductor-config", "no_such_setting=1"], "is not NAME=VALUE"),
                (["--inductor-config", "triton.no_such_setting=1"], "is not NAME=VALUE"),
                (["--inductor-config", "triton.=1"], "is not NAME=VALUE"),
                (["--inductor-config", "fallback_random=Tru"], "is no Python literal"),
                (["--inductor-config", "fallback_random=True", "--no-compile"],
                 "--inductor-config needs compiled layers"),
                (["--peer"], "--num-layers with the peer"),
                (["--num-layers", "0"], "num_hidden_layers must be a positive integer")]
    assert_refused(runs_in_one_interpreter(common[2:], [flags for flags, _ in refusals]),
                   [reason for _, reason in refusals])


class _FreezeWatcher:
    """Steps a tiny Linear like the engine's interface (forward, backward, step) and notes
    whether the collector had frozen objects at each step."""

    def __init__(self) -> None:
        self.layer = torch.nn.Linear(4, 1)
        self.frozen_at_step: list[bool] = []

    def __call__(self, x):
        import gc
        import types

        self.frozen_at_step.append(gc.get_freeze_count() > 0)
        return types.SimpleNamespace(loss=self.layer(x).sum())

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.layer.zero_grad()


@pytest.mark.parametrize("freeze", [True, False])
def test_timed_steps_run_frozen_unless_the_diagnostic_says_not(freeze):
    """As the loop (training.host_gc): warm-up steps as they come, timed steps with the
    survivors frozen, and `--no-gc-freeze` times them without; nothing stays frozen after."""
    import argparse
    import gc

    gt = load_script()
    engine = _FreezeWatcher()
    args = argparse.Namespace(compile_mode="default", warmup=2, steps=3, device="cpu",
                              gc_freeze=freeze)
    seconds, losses, collections = gt.time_steps(engine, [{"x": torch.ones(2, 4)}], args)
    assert engine.frozen_at_step == [False, False] + [freeze] * 3
    assert len(seconds) == len(losses) == 3
    if freeze:  # the freeze's own full collection is no pass inside a timed step
        assert collections.full_passes() == []
    assert gc.get_freeze_count() == 0
