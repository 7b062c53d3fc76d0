"""Issue 11, item 6: the real training loop on BERT-large on a GPU, end to end, without Ray.

What runs is `bertforge train`'s own loop (`bertforge.training.loop.train`), single process (or
under the `deepspeed` launcher), on a prepared shard directory on disk:

1. train to `--steps // 2` and commit a checkpoint there;
2. run the same command again to `--steps`: it must resume from that checkpoint (the first step
   it logs is past it), as `--resume auto` does after a failure;
3. export the final checkpoint to a Hugging Face directory (`bertforge export`'s code);
4. assert the loss fell: the mean of the last tenth of logged steps is below the mean of the
   first tenth by at least `--min-drop` (nats);
5. profile a window of the resumed run (`--profile-steps`, the loop's own `profile_steps`;
   by default the 12 steps before its last, a log line among them) and assert that the host
   waits for the device only at log lines: no per-step host syncs. The final checkpoint stays
   out of the window (its seconds of saving would read as an idle GPU); what it costs is the
   loop's own `checkpoint_seconds`, reported beside a step's time.

It writes `gpu_proof_run-DEVICE-DATE.json` and `.md` to `--output-dir` (the device's name, the
date, the commit, the resolved recipe, the logged losses, tokens/s and MFU of the loop itself)
and exits 1 when an assertion fails. The data should be real text (a random-token dataset has
nothing to learn); `benchmarks/README.md` says how to prepare shards here and carry them.

    python3 benchmarks/gpu_proof_run.py --data .gpu-data/shards-128 --output-dir $OUT
    python3 benchmarks/gpu_proof_run.py --data DIR --preset tiny --steps 40 --precision fp32 \\
        --micro-batch 8 --lr 3e-3 --min-drop 0.05 --output-dir /tmp/proof   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import subprocess
import sys

from bertforge.training.config import TrainConfig
from bertforge.training.export import export_checkpoint
from bertforge.training.loop import train
from bertforge.training.metrics import read_metrics
from bertforge.training.recipes import bert_large_phase1

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Dense bf16 peak TFLOP/s per device (NVIDIA datasheets), for the loop's MFU.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def check_parser(doc: str, *, runs: str, steps: int, steps_help: str) -> argparse.ArgumentParser:
    """The options a check script of the real loop shares (this one's and gpu_parity.py's):
    the shards, where results and `runs` go, the model, the steps, the learning rate, the
    commit to record."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prepared shard directory (real text)")
    parser.add_argument("--output-dir", required=True, help=f"results and {runs}")
    parser.add_argument("--preset", default="large", help="model size (large, base, tiny)")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    parser.add_argument("--commit", default=None,
                        help="the source commit to record when the tree has no .git")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = check_parser(__doc__, runs="the run directory", steps=300,
                          steps_help="optimizer steps in all")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per step (default: the recipe's rule for the device, "
                             "training.recipes.micro_batch_for_device)")
    parser.add_argument("--log-every", type=int, default=10,
                        help="steps per log line: the loop reads the device once a line")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--zero-stage", type=int, default=None,
                        help="default: the recipe's for the live world size")
    parser.add_argument("--min-drop", type=float, default=0.5,
                        help="nats the loss must fall from the first to the last tenth")
    parser.add_argument("--packing", action="store_true",
                        help="several instances a row (TrainConfig.packing)")
    parser.add_argument("--fp8", action="store_true",
                        help="the encoder's FP8 GEMMs (TrainConfig.fp8, opt-in; bf16 only)")
    parser.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"),
                        default=None, help="steps of the resumed run to profile (default: "
                        "the 12 before its last)")
    parser.add_argument("--no-profile", action="store_true", help="profile no step")
    args = parser.parse_args(argv)
    if args.profile_steps is None and not args.no_profile:
        args.profile_steps = (max(args.steps // 2 + 1, args.steps - 12), args.steps - 1)
    if args.no_profile or args.profile_steps[0] > args.profile_steps[1]:
        args.profile_steps = None  # too short a run for a window past its resume
    return args


def recipe(args: argparse.Namespace, run_dir: str, max_steps: int,
           profile_steps: tuple[int, int] | None = None) -> TrainConfig:
    """bert_large_phase1's settings at a proof run's size: no accumulation, a short warm-up."""
    overrides = dict(
        model={"preset": args.preset}, max_steps=max_steps, micro_batch_size=args.micro_batch,
        global_batch_size=None, gradient_accumulation_steps=1, learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10), precision=args.precision,
        log_every=args.log_every,
        checkpoint_every=args.steps // 2, keep_checkpoints=2, eval_every=0, resume=True,
        peak_tflops=_peak_tflops(), packing=args.packing, fp8=args.fp8,
        profile_steps=profile_steps,
    )
    if args.zero_stage is not None:
        overrides["zero_stage"] = args.zero_stage
    return bert_large_phase1(args.data, run_dir, **overrides)


def _peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def source_commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> dict:
    run_dir = os.path.join(args.output_dir, "run")
    half = args.steps // 2
    first = train(recipe(args, run_dir, half))
    second = train(recipe(args, run_dir, args.steps, args.profile_steps))
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    resumed_at = min((r["step"] for r in records if r["step"] > half), default=None)
    hf_dir = export_checkpoint(run_dir, os.path.join(args.output_dir, "hf"))
    by_step = {r["step"]: r for r in records}
    steps = sorted(by_step)
    tenth = max(1, len(steps) // 10)
    loss_start = statistics.mean(by_step[s]["loss"] for s in steps[:tenth])
    loss_end = statistics.mean(by_step[s]["loss"] for s in steps[-tenth:])
    profile = _loop_profile(run_dir, args.profile_steps)
    profiled = range(profile["steps"][0], profile["steps"][1] + 1) if profile else range(0)
    # The first steps include compilation; the profiled ones the profiler's overhead.
    timed = [by_step[s] for s in steps[tenth:] if s not in profiled]
    checks = {
        "checkpoint_at_half": first.global_step == half,
        # The resumed run's first log line is the first multiple of log_every past the half.
        "resumed_past_half": resumed_at is not None and half < resumed_at <= half + args.log_every,
        "reached_steps": second.global_step == args.steps,
        "export_written": os.path.isfile(os.path.join(hf_dir, "model.safetensors")),
        "loss_fell": loss_start - loss_end >= args.min_drop,
    }
    if profile is not None:
        # The loop reads the device once a log line (its metrics), never between them.
        log_lines = {s for s in profiled if s % args.log_every == 0}
        checks["host_syncs_only_at_log_lines"] = (
            set(profile["steps_with_host_syncs"]) <= log_lines)
    return {
        "device": device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(args.commit),
        "recipe": _resolved_recipe(run_dir),
        "loss_first_tenth": loss_start,
        "loss_last_tenth": loss_end,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu_median": (statistics.median(r["mfu"] for r in timed)
                       if timed and "mfu" in timed[0] else None),
        "losses": {s: by_step[s]["loss"] for s in steps},
        "loop_profile": profile,
        "final_checkpoint_seconds": second.checkpoint_seconds,
        "checks": checks,
        "passed": all(checks.values()),
    }


def _loop_profile(run_dir: str, steps: tuple[int, int] | None) -> dict | None:
    """The summary the loop wrote for the profiled window (training.profiling), named after
    the steps it profiled: those of the window that the resumed run ran."""
    if steps is None:
        return None
    [path] = glob.glob(os.path.join(run_dir, "profile", "steps-*-rank0.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _resolved_recipe(run_dir: str) -> dict:
    """The recipe as the loop resolved it (micro-batch, ZeRO stage, precision, compile)."""
    with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)["train"]


def save_report(output_dir: str, script: str, result: dict, lines: list[str]) -> str:
    """A check script's results (this one's, gpu_parity.py's, gradient_fidelity.py's) as
    SCRIPT-DEVICE-DATE.json and .md in `output_dir`, the markdown printed too; returns the
    files' stem."""
    stem = os.path.join(output_dir,
                        f"{script}-{result['device'].replace(' ', '-')}-{result['date']}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return stem


def write_results(result: dict, output_dir: str) -> str:
    mfu, recipe = result["mfu_median"], result["recipe"]
    lines = [
        f"# Real-loop proof run: {result['device']}, {result['date']}, commit {result['commit']}",
        "",
        "| measure | value |", "|---|---|",
        f"| loss, first tenth of steps | {result['loss_first_tenth']:.3f} |",
        f"| loss, last tenth of steps | {result['loss_last_tenth']:.3f} |",
        f"| tokens/s (median step, loop's own metric) | {result['tokens_per_s_median']:,.0f} |",
        f"| MFU (median step, computed FLOPs) | {'n/a' if mfu is None else f'{mfu:.1%}'} |",
        f"| micro-batch x accumulation, ZeRO stage, compiled layers | "
        f"{recipe['micro_batch_size']} x {recipe['gradient_accumulation_steps']}, "
        f"{recipe['zero_stage']}, {recipe['compile']}"
        f"{', packed rows' if recipe.get('packing') else ''}"
        f"{', FP8 GEMMs' if recipe.get('fp8') else ''} |",
        *_profile_rows(result["loop_profile"]),
        f"| the final checkpoint: seconds saving (the loop's checkpoint_seconds) | "
        f"{result['final_checkpoint_seconds']:.2f} |",
        *(f"| {name} | {'yes' if ok else 'NO'} |" for name, ok in result["checks"].items()),
    ]
    return save_report(output_dir, "gpu_proof_run", result, lines)


def _profile_rows(profile: dict | None) -> list[str]:
    if profile is None:
        return []
    first, last = profile["steps"]
    busy, kernels = profile["gpu_busy"], profile["kernels_per_step"]
    synced = ", ".join(map(str, profile["steps_with_host_syncs"])) or "none"
    rows = [f"| profiled steps {first}-{last}: wall ms a step (profiler on) "
            f"| {profile['wall_ms_per_step']:.1f} |",
            f"| profiled: GPU busy, kernels a step | "
            f"{'n/a' if busy is None else f'{busy:.0%}'}, "
            f"{'n/a' if kernels is None else f'{kernels:,.0f}'} |",
            f"| profiled: steps in which the host waited for the device | {synced} |"]
    if profile["category_ms_per_step"]:
        categories = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(
            profile["category_ms_per_step"].items(), key=lambda kv: -kv[1]))
        rows.append(f"| profiled: kernel ms a step by category | {categories} |")
    return rows


def run_checks(parse, run_all, write, argv: list[str] | None) -> int:
    """A check script's main (this one's and gpu_parity.py's): parse, run, write the results
    to --output-dir, exit 1 when a check failed."""
    args = parse(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    result = run_all(args)
    write(result, args.output_dir)
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_checks(parse_args, run, write_results, argv)


if __name__ == "__main__":
    sys.exit(main())
