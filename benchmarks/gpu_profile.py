"""Where one BERT training step spends its GPU time: our engine's step against the HF peer's.

Cases (`--cases`, comma-separated, each `<kind><seq len>x<micro-batch>`):
- `ours128x256`: our model in the DeepSpeed engine exactly as gpu_throughput.py builds it (its
  `parse_args`, `plan_cases`, `train_config`, `make_batches`; its default settings, plus
  `--engine-args`, e.g. `--engine-args="--compile"`: with `=`, as its value starts with --);
- `fp8128x256`: the `ours` case with `--fp8` (training.fp8: the encoder's GEMMs in FP8, opt-in),
  to see where the casts it adds spend their time;
- `before128x256`: our engine as `ours` builds it, with the settings used before the fast path
  (`--zero-stage 2 --no-compile`: DeepSpeed's bf16 weights and ZeRO-2 optimizer, eager; the
  optimizer inside is ClippedAdamW with its clip off, i.e. torch's fused AdamW as before;
  DeepSpeed's throughput timer, whose syncs the 2026-11-26 profile's `before` row still had, is
  off here too);
- `hfc128x256` / `hf128x256`: the transformers peer of gpu_peer_hf.py (its step function),
  compiled / eager.

Each case: build, `--warmup` untimed steps, `--timed` synchronized steps (their median is the
wall time a step), then `torch.profiler` (CPU + CUDA activities) over `--profiled` steps. CUDA
kernel time is summed by category (the first category whose keyword is in the kernel's name;
see training.profiling.CATEGORIES; ranges such as `Optimizer.step#...`, which the profiler
mirrors on the GPU's timeline, are not kernels), over the profiled wall time: GPU busy. A step
that is mostly kernels is compute-bound; one with the GPU idle much of the time is bound by
launches, host work or syncs.
The top `--top` kernels by time are listed per case, then inductor's Triton kernels against the
memory bandwidth (kernel_bandwidth.py): the bytes each moves, as inductor estimates them, over
its time, beside a device copy measured first, and the kernels that lose most time to it (those
drawing dropout's random numbers marked). On a CPU (`--device cpu`, a smoke run) there are no
kernels: the wall times are still measured, GPU busy and bandwidth are n/a.

Output: markdown (`--out`; default benchmarks/results/gpu_profile_<device>_<date>[_<tag>].md,
never overwriting: `_2`, `_3`) with a summary table first and one section per case, and JSON of
the same numbers beside it (same name, .json). Both are rewritten after each case, so a run cut
short keeps the cases it finished.

    python benchmarks/gpu_profile.py                            # ours128x256,ours128x64,...
    python benchmarks/gpu_profile.py --cases ours128x256,hfc128x256 --engine-args="--compile"
    CUDA_VISIBLE_DEVICES= python benchmarks/gpu_profile.py --device cpu --config tiny \\
        --cases ours128x8,before128x8,hfc128x4 --warmup 1 --timed 2 --profiled 1 \\
        --out /tmp/prof.md                                     # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# gpu_throughput.py and gpu_peer_hf.py beside this file; tests.support from the checkout.
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import gpu_peer_hf  # noqa: E402
import gpu_throughput as gt  # noqa: E402
import kernel_bandwidth  # noqa: E402

from bertforge.training.host_gc import FrozenSurvivors  # noqa: E402

# The training loop's own profile (`bertforge train --profile-steps`) sorts kernels the same way.
from bertforge.training.profiling import (  # noqa: E402
    CATEGORIES,
    CATEGORY_NAMES,
    OTHER,
    device_kernels,
    kernel_category,
    without_cycle_warning,
)

CASE_PATTERN = re.compile(r"^(ours|fp8|before|hfc|hf)(\d+)x(\d+)$")
KINDS = {
    "ours": "our engine, gpu_throughput.py's settings",
    "fp8": "our engine, gpu_throughput.py's settings with --fp8",
    "before": "our engine, the earlier settings (ZeRO-2, eager)",
    "hfc": "transformers peer, torch.compile",
    "hf": "transformers peer, eager",
}
PEER_KINDS = ("hfc", "hf")
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="ours128x256,ours128x64,hfc128x256,before128x256",
                        help="comma-separated <ours|fp8|before|hfc|hf><seq len>x<micro-batch>")
    parser.add_argument("--config", choices=sorted(gpu_peer_hf.SHAPES), default="large",
                        help="model preset of our cases and the peer's shape (tiny: smoke run)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--engine-args", default="",
                        help="more gpu_throughput.py options for the `ours` cases, one string "
                             "given with '=' (it starts with --): --engine-args='--compile'")
    parser.add_argument("--warmup", type=int, default=6,
                        help="untimed steps first (a compiled case compiles each new batch "
                             "width here)")
    parser.add_argument("--timed", type=int, default=10, help="unprofiled timed steps")
    parser.add_argument("--profiled", type=int, default=5, help="steps under the profiler")
    parser.add_argument("--num-batches", type=int, default=8, help="distinct batches, cycled")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per case")
    parser.add_argument("--out", default=None, help="markdown file (default: see the module)")
    parser.add_argument("--output-dir", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--kernel-sources", default=None, metavar="FOLDER",
                        help="copy the source of every Triton kernel inductor compiled into "
                             "FOLDER after each case (gpu_check.sh brings it back as "
                             "inductor_kernels.tar.gz)")
    parser.add_argument("--tag", default="", help="appended to the default file name")
    parser.add_argument("--commit", default=None, help="source commit (default: from git)")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.timed < 1 or args.profiled < 1 or args.num_batches < 1:
        parser.error("--timed, --profiled and --num-batches must be >= 1, --warmup >= 0")
    args.case_list = []
    for name in (c.strip() for c in args.cases.split(",") if c.strip()):
        match = CASE_PATTERN.match(name)
        if match is None:
            parser.error(f"--cases: {name!r} is not "
                         "<ours|fp8|before|hfc|hf><seq len>x<micro-batch>")
        args.case_list.append((name, match[1], int(match[2]), int(match[3])))
    return args


# --- building a case: (step function, what to free afterwards, what it ran) ------------------


def gt_args(args: argparse.Namespace, kind: str, seq_len: int, micro_batch: int):
    """gpu_throughput.py's options for one of our cases."""
    argv = ["--config", args.config, "--device", args.device, "--seq-lens", str(seq_len),
            "--micro-batch", str(micro_batch), "--num-batches", str(args.num_batches)]
    if kind in ("ours", "fp8"):
        fp8 = ["--fp8"] if kind == "fp8" else []
        return gt.parse_args(argv + shlex.split(args.engine_args) + fp8)
    return gt.parse_args(argv + ["--zero-stage", "2", "--no-compile"])  # before the fast path


def build_ours(args: argparse.Namespace, kind: str, seq_len: int, micro_batch: int):
    """Model + engine + batches as gpu_throughput.measure builds them."""
    from bertforge.training.engine import build_engine
    from bertforge.training.resolved_engine import resolve_engine

    targs = gt_args(args, kind, seq_len, micro_batch)
    case = gt.plan_cases(targs)[0]
    cfg = gt.train_config(targs, case)
    # What the builder decides for settings left to it (None: by the machine), for the record.
    resolved = resolve_engine(cfg.engine(), 1)
    cpu_batches, vocab_size, _ = gt.make_batches(case, targs, 0, 1)
    model = gt.build_model(targs, case, vocab_size, cfg)
    engine = build_engine(model, resolved)  # compiles when the config says so
    gt.recompile_layers(model, targs, engine.device)  # its experiments, if any
    batches = [{k: v.to(engine.device) for k, v in b.items()} for b in cpu_batches]

    def step(i: int) -> torch.Tensor:
        out = engine(**batches[i % len(batches)])
        engine.backward(out.loss)
        engine.step()
        return out.loss.detach()

    def release() -> None:
        engine.destroy()
        batches.clear()

    settings = {
        "gpu_throughput_args": parsed_settings(targs),
        "zero_stage": engine.zero_optimization_stage(), "precision": resolved.config.precision,
        "optimizer": resolved.config.optimizer, "compile": resolved.config.compile,
        "bf16_residual": resolved.config.bf16_residual, "fp8": resolved.config.fp8,
        "activation_checkpointing": cfg.activation_checkpointing,
    }
    return step, release, settings


def parsed_settings(targs: argparse.Namespace) -> list[str]:
    """What gpu_throughput.py parsed that shapes the engine, for the record."""
    keep = ("config", "zero_stage", "precision", "optimizer", "activation_checkpointing",
            "compile", "fp8", "micro_batch", "seq_lens", "num_batches", "packing", "attention",
            "dropout_mask", "dropout", "inductor_config", "compile_mode")
    return [f"{k}={getattr(targs, k)}" for k in keep if hasattr(targs, k)]


def build_peer(args: argparse.Namespace, kind: str, seq_len: int, micro_batch: int):
    import transformers

    peer = gpu_peer_hf.build_peer(args.config, seq_len, micro_batch, args.device,
                                  compile=kind == "hfc", num_batches=args.num_batches)
    settings = {"transformers": transformers.__version__, "compile": peer.compiled,
                "attn_implementation": peer.attn_implementation,
                "precision": "fp32 weights, bf16 autocast", "optimizer": "torch AdamW fused"}
    return peer.step, lambda: gpu_peer_hf.release(peer), settings


# --- measuring ------------------------------------------------------------------------------


def run_case(step: Callable[[int], torch.Tensor], args: argparse.Namespace,
             copy_gbps: float | None = None) -> dict[str, Any]:
    """Warm up, time `--timed` steps, profile `--profiled` steps; kernel time by category, and
    inductor's kernels against `copy_gbps` (kernel_bandwidth)."""
    cuda = args.device == "cuda"
    started = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    gt.synchronize(args.device)
    warmup_s = time.perf_counter() - started
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # Every case's timed and profiled steps as the loop's and gpu_throughput.py's: what is alive
    # after warm-up frozen, no full collection of the collector's own (training/host_gc.py).
    with FrozenSurvivors() as survivors:
        survivors.freeze()
        for i in range(args.warmup, args.warmup + args.timed):
            started = time.perf_counter()
            loss = step(i)
            gt.synchronize(args.device)
            seconds.append(time.perf_counter() - started)
        first = args.warmup + args.timed
        with without_cycle_warning(), profile(activities=activities) as prof:
            started = time.perf_counter()
            for i in range(first, first + args.profiled):
                step(i)
            gt.synchronize(args.device)
            profiled_s = time.perf_counter() - started
    n = args.profiled
    by_category = dict.fromkeys(CATEGORY_NAMES, 0.0)  # microseconds over all profiled steps
    kernels: dict[str, list[float]] = {}  # name: [calls, microseconds]
    for name, us in device_kernels(prof.events()):
        by_category[kernel_category(name)] += us
        entry = kernels.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    kernel_ms = sum(by_category.values()) / 1e3 / n
    profiled_ms = 1e3 * profiled_s / n
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]
    return {
        "warmup_s": warmup_s,
        "wall_ms_median": 1e3 * statistics.median(seconds), "wall_ms_min": 1e3 * min(seconds),
        "profiled_ms_per_step": profiled_ms,
        "kernel_ms_per_step": kernel_ms,
        # The profiler's own overhead is in profiled_s; kernel time over it is a lower bound.
        "gpu_busy": kernel_ms / profiled_ms if cuda else None,
        "kernels_per_step": sum(calls for calls, _ in kernels.values()) / n,
        "category_ms_per_step": {c: us / 1e3 / n for c, us in by_category.items()},
        "top_kernels": [{"name": name, "category": kernel_category(name),
                         "ms_per_step": us / 1e3 / n, "calls_per_step": calls / n}
                        for name, (calls, us) in top],
        "bandwidth": kernel_bandwidth.bandwidth_report(
            kernels, kernel_bandwidth.loaded_kernels(), copy_gbps, n),
        "loss_last_timed": loss.item(),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
    }


def profile_case(args: argparse.Namespace, name: str, kind: str, seq_len: int,
                 micro_batch: int, copy_gbps: float | None) -> dict[str, Any]:
    """Build one case, run it (`run_case`) and free what it held."""
    started = time.perf_counter()
    cache_before = graph_cache_counts()
    build = build_peer if kind in PEER_KINDS else build_ours
    step, release, settings = build(args, kind, seq_len, micro_batch)
    build_s = time.perf_counter() - started
    try:
        measured = run_case(step, args, copy_gbps)
        measured["graph_cache"] = {key: graph_cache_counts()[key] - cache_before[key]
                                   for key in cache_before}
    finally:
        release()
        compiled = settings["compile"]
        del step, release
        if compiled:
            torch._dynamo.reset()  # drop the compiled graphs before the next case
        free_device()
    return {"case": name, "kind": kind, "description": KINDS[kind], "seq_len": seq_len,
            "micro_batch": micro_batch, "settings": settings, "build_s": build_s, **measured}


def graph_cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache hits and misses in this process so far: whether a case's
    compile found an earlier one's (a hit skips the code generation and the kernels' builds)."""
    from torch._dynamo.utils import counters

    return {"hits": counters["inductor"]["fxgraph_cache_hit"],
            "misses": counters["inductor"]["fxgraph_cache_miss"]}


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- output ---------------------------------------------------------------------------------


def output_paths(args: argparse.Namespace, device: str, date: str) -> tuple[str, str]:
    """(markdown, JSON): `--out`, or gpu_throughput.output_paths' rule (never overwriting)."""
    if args.out:
        return args.out, os.path.splitext(args.out)[0] + ".json"
    json_path, md_path = gt.output_paths(args.output_dir, device, date, args.tag, "gpu_profile")
    return md_path, json_path


def _ms(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:,.1f}"


def _busy(r: dict[str, Any]) -> str:
    return "n/a" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f} %"


def _cache(r: dict[str, Any]) -> str:
    cache = r.get("graph_cache")
    if not cache or not (cache["hits"] or cache["misses"]):
        return ""
    return f" (inductor's graph cache: {cache['hits']} hits, {cache['misses']} misses)"


def summary_table(results: list[dict[str, Any]]) -> str:
    header = ("| case | wall ms/step | GPU busy % | kernels/step | gemm ms | attention ms "
              "| optimizer ms | norm ms | elementwise ms | copy/cast ms |")
    lines = [header, "|---|" + "---:|" * (header.count(" | "))]
    for r in results:
        # No kernels (a CPU run): n/a, not 0 ms.
        c = {k: _ms(v) if r["top_kernels"] else "n/a"
             for k, v in r["category_ms_per_step"].items()}
        lines.append(
            f"| {r['case']} | {_ms(r['wall_ms_median'])} | {_busy(r)} "
            f"| {r['kernels_per_step']:,.0f} | {c['gemm']} | {c['attention']} "
            f"| {c['optimizer']} | {c['norm']} | {c[OTHER]} | {c['copy/cast']} |")
    return "\n".join(lines)


def case_section(r: dict[str, Any]) -> str:
    settings = ", ".join(f"{k} {v}" for k, v in r["settings"].items()
                         if v is not None and k != "gpu_throughput_args")
    lines = [
        f"## {r['case']}: {r['description']}, {r['seq_len']} x {r['micro_batch']}",
        "",
        f"- settings: {settings}",
    ]
    if r["settings"].get("gpu_throughput_args"):
        parsed = ", ".join(r["settings"]["gpu_throughput_args"])
        lines.append(f"- gpu_throughput.py parsed: {parsed}")
    lines += [
        f"- build {r['build_s']:.1f} s, warm-up {r['warmup_s']:.1f} s{_cache(r)}; wall "
        f"{_ms(r['wall_ms_median'])} ms/step (median; fastest {_ms(r['wall_ms_min'])}), "
        f"profiled {_ms(r['profiled_ms_per_step'])} ms/step; kernels "
        f"{_ms(r['kernel_ms_per_step'])} ms/step, GPU busy {_busy(r)}, "
        f"{r['kernels_per_step']:,.0f} kernels/step; last timed loss {r['loss_last_timed']:.3f}"
        + ("" if r["peak_memory_gib"] is None
           else f"; peak memory {r['peak_memory_gib']:.1f} GiB"),
    ]
    if not r["top_kernels"]:
        return "\n".join(lines + ["", "No CUDA kernels (a CPU run): wall times only."])
    lines += ["", "| category | ms/step | share of kernel time |", "|---|---:|---:|"]
    total = r["kernel_ms_per_step"]
    for cat, ms in sorted(r["category_ms_per_step"].items(), key=lambda kv: -kv[1]):
        share = f"{100 * ms / total:.1f} %" if total else "n/a"
        lines.append(f"| {cat} | {_ms(ms)} | {share} |")
    lines += ["", f"Top {len(r['top_kernels'])} kernels:", "",
              "| ms/step | calls/step | category | kernel |", "|---:|---:|---|---|"]
    for k in r["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 110 else k["name"][:107] + "..."
        name = name.replace("|", "\\|")
        lines.append(f"| {_ms(k['ms_per_step'])} | {k['calls_per_step']:g} "
                     f"| {k['category']} | `{name}` |")
    bandwidth = kernel_bandwidth.markdown(r["bandwidth"]) if "bandwidth" in r else []
    return "\n".join(lines + ([""] + bandwidth if bandwidth else []))


def markdown(report: dict[str, Any]) -> str:
    env, setup = report["environment"], report["setup"]
    parts = [
        f"# Where a BERT training step spends its GPU time: {env['device']}, {env['date']}",
        "",
        f"- command: `{env['command']}`",
        f"- commit: {env['commit'] or 'unknown'}; torch {env['torch']}, CUDA {env['cuda']}, "
        f"Python {env['python']}",
        f"- model: {setup['config']}; per case {setup['warmup']} warm-up steps, "
        f"{setup['timed']} timed steps (wall: their median, synchronized), then "
        f"{setup['profiled']} steps under torch.profiler; {setup['num_batches']} distinct "
        "synthetic batches cycled, already on the device",
        f"- `ours` (and `fp8`) cases: gpu_throughput.py's settings plus "
        f"`{setup['engine_args'] or '(none)'}`",
        "- GPU busy: CUDA kernel time over the profiled wall time (the profiler's overhead "
        "included, so a lower bound). Categories by kernel name (training.profiling.CATEGORIES); "
        "elementwise = everything no category named; ms are per step",
        "- Triton kernels against the bandwidth (benchmarks/kernel_bandwidth.py): bytes a call as "
        "inductor estimates them, a device-to-device copy "
        + (f"measured at {env['copy_gbps']:,.0f} GB/s" if env.get("copy_gbps")
           else "not measured (no GPU)"),
        "",
        summary_table(report["results"]),
        "",
    ]
    for r in report["results"]:
        parts += [case_section(r), ""]
    return "\n".join(parts)


def write(report: dict[str, Any], md_path: str, json_path: str) -> None:
    for path, text in ((md_path, markdown(report)), (json_path, json.dumps(report, indent=2))):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    gt.check_device(args.device)  # DeepSpeed would take a visible GPU even with --device cpu
    from bertforge.training.engine import ensure_process_group

    ensure_process_group()
    if args.device == "cuda":
        torch.cuda.set_device(0)
    copy_gbps = kernel_bandwidth.copy_bandwidth_gbps(args.device)
    device = gt.device_name(args.device)
    now = datetime.datetime.now(datetime.timezone.utc)
    report = {
        "environment": {
            "device": device, "device_type": args.device, "date": now.strftime("%Y-%m-%d"),
            "time_utc": now.isoformat(timespec="seconds"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "commit": gt.source_commit(args),
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "copy_gbps": copy_gbps,
        },
        "setup": {key: getattr(args, key) for key in (
            "config", "cases", "engine_args", "warmup", "timed", "profiled", "num_batches")},
        "categories": {name: list(keys) for name, keys in CATEGORIES},
        "results": [],
    }
    md_path, json_path = output_paths(args, device, report["environment"]["date"])
    estimates_broke = False
    for name, kind, seq_len, micro_batch in args.case_list:
        # Each Triton kernel's bytes, for the time it loses against a copy: for our cases. The
        # estimates are part of inductor's cache key, so the peer compiles without them and
        # finds what gpu_throughput.py's peer runs compiled before it on the same machine (its
        # compile took 65 s on the H200 when it did not).
        if kind in PEER_KINDS or estimates_broke:
            kernel_bandwidth.disable_estimates()
        else:
            kernel_bandwidth.enable_estimates()
        try:
            result = profile_case(args, name, kind, seq_len, micro_batch, copy_gbps)
        except (BackendCompilerFailed, InductorError) as failed:
            if not kernel_bandwidth.estimates_enabled():
                raise
            # The estimates come from a debugging switch of inductor's: where it breaks a
            # compile, the profile matters more than its bandwidth section.
            print(f"[gpu_profile] {name}: the compile failed with inductor's size estimates on "
                  f"({type(failed).__name__}); again without them", flush=True)
            estimates_broke = True
            kernel_bandwidth.disable_estimates()
            result = profile_case(args, name, kind, seq_len, micro_batch, copy_gbps)
        report["results"].append(result)
        write(report, md_path, json_path)
        if args.kernel_sources:
            kernel_bandwidth.save_sources(args.kernel_sources)
        print(f"[gpu_profile] {name}: {result['wall_ms_median']:.1f} ms/step, GPU busy "
              f"{_busy(result)}, {result['kernels_per_step']:,.0f} kernels/step", flush=True)
    print("\n" + markdown(report))
    print(f"wrote {md_path}\nwrote {json_path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
