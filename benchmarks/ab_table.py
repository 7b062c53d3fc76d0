"""One table of gpu_throughput.py runs made in the same call: each run's step time, sequences/s
and MFU at each length, its sequences/s over the run tagged `defaults` (gpu_check.sh's
"variants" stage: the experiments beside the project's defaults), and how often inductor left
CUDA graphs out (a CUDA-graph variant with skips did not measure what it is named after).

    python3 benchmarks/ab_table.py OUT/gpu_throughput_*variant-*.json

A run's name is its result file's tag (`--tag variant-NAME` gives NAME).
"""

from __future__ import annotations

import json
import os
import re
import sys

BASELINE = "defaults"


def run_name(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    match = re.search(r"variant-(.+?)(?:_\d+)?$", stem)
    return match[1] if match else stem


def read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def table(paths: list[str]) -> str:
    runs = {run_name(path): read(path) for path in paths}
    names = sorted(runs, key=lambda name: (name != BASELINE, name))
    baseline = {r["seq_len"]: r["sequences_per_s"]
                for r in runs.get(BASELINE, {}).get("results", [])}
    base_loss = {r["seq_len"]: r["loss_last"] for r in runs.get(BASELINE, {}).get("results", [])}
    lines = [f"| run | seq len x micro-batch | step ms (median) | seq/s | MFU needed "
             f"| over {BASELINE} | last loss | its difference from {BASELINE}' "
             f"| CUDA graphs skipped |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        for r in runs[name]["results"]:
            base = baseline.get(r["seq_len"])
            ratio = f"{r['sequences_per_s'] / base:.3f}x" if base else "n/a"
            lines.append(f"| {name} | {r['seq_len']} x {r['micro_batch']} "
                         f"| {r['step_ms_median']:.1f} | {r['sequences_per_s']:,.1f} "
                         f"| {100 * r['mfu_needed']:.1f} % | {ratio} | {r['loss_last']:.6f} "
                         f"| {_relative(r['loss_last'], base_loss.get(r['seq_len']))} "
                         f"| {r.get('cudagraph_skips', 'n/a')} |")
    first = runs[names[0]]["environment"]
    return "\n".join([f"# gpu_throughput.py variants: {first['device']}, {first['date']}, "
                      f"commit {first['commit']}", "", *lines])


def _relative(loss: float, base: float | None) -> str:
    """The last timed step's loss against the defaults' on the same batch: 0 where a variant
    is meant to keep the arithmetic (GPU kernels may still differ in their last bits)."""
    if base is None:
        return "n/a"
    return f"{abs(loss - base) / abs(base):.1e}"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
