"""The demo's summary: the numbers of every stage, printed, in DIR/summary.json, and the loss
curve in DIR/loss_curve.png."""

from __future__ import annotations

import json
from typing import Any

from bertforge.cluster.demo.config import DemoPaths
from bertforge.cluster.demo.sst2 import summary_rows
from bertforge.training.metrics import read_metrics


def training_statistics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last logged loss, and tokens/s over all logged windows, per step logged once."""
    by_step = {r["step"]: r for r in records if "loss" in r}  # a resumed run may relog a step
    steps = sorted(by_step)
    tokens = sum(by_step[s]["tokens"] for s in steps)
    seconds = sum(by_step[s]["tokens"] / by_step[s]["tokens_per_s"] for s in steps)
    return {
        "step": steps[-1],
        "loss_first": by_step[steps[0]]["loss"],
        "loss_last": by_step[steps[-1]]["loss"],
        "tokens_per_second": tokens / seconds,
    }


def summarise(paths: DemoPaths, state: dict[str, Any], seconds_now: float) -> dict[str, Any]:
    """The summary from the stages' records (whichever run made them): written, plotted,
    printed and returned."""
    stages = state["stages"]
    train, evaluation = stages["train"], stages["eval"]
    summary = {
        "steps": train["step"],
        "loss_first": train["loss_first"],
        "loss_last": train["loss_last"],
        "mlm_accuracy": evaluation["mlm_accuracy"],
        "mlm_baseline_accuracy": evaluation["mlm_baseline_accuracy"],
        "nsp_accuracy": evaluation["nsp_accuracy"],
        "tokens_per_second": train["tokens_per_second"],
        # Compute time of every stage, whichever run did it; this_run_seconds is this call's.
        "wall_seconds": round(sum(s["seconds"] for s in stages.values()), 1),
        "this_run_seconds": round(seconds_now, 1),
        "stage_seconds": {name: s["seconds"] for name, s in stages.items()},
        "instances": _instances(stages["prepare"]),
        "hf_dir": paths.hf,
        "loss_curve": paths.loss_curve,
        "finetune_sst2": stages["finetune"],
    }
    _plot_loss_curve(read_metrics(paths.run), paths.loss_curve)
    with open(paths.summary, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(format_summary(summary), flush=True)
    return summary


def _instances(prepare: dict[str, Any]) -> int | None:
    """The prepare stage's instance count; a demo directory recorded before the stage bodies
    were shared with `pipeline` holds the job's whole summary under "counts"."""
    if "instances" in prepare:
        return prepare["instances"]
    return prepare.get("counts", {}).get("instances")


def format_summary(summary: dict[str, Any]) -> str:
    rows = [
        ("steps", f"{summary['steps']}"),
        ("loss first -> last", f"{summary['loss_first']:.3f} -> {summary['loss_last']:.3f}"),
        ("MLM accuracy", f"{summary['mlm_accuracy']:.3f}"),
        ("MLM baseline (most frequent token)", f"{summary['mlm_baseline_accuracy']:.3f}"),
        ("NSP accuracy", f"{summary['nsp_accuracy']:.3f}"),
        ("training tokens/s", f"{summary['tokens_per_second']:,.0f}"),
        *summary_rows(summary["finetune_sst2"]),
        ("wall seconds (all stages)", f"{summary['wall_seconds']:.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["", "bertforge demo summary", "-" * (width + 14)]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"Hugging Face export: {summary['hf_dir']}")
    return "\n".join(lines)


def _plot_loss_curve(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    by_step = {r["step"]: r for r in records if "loss" in r}  # a resumed run may log a step twice
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [by_step[s]["loss"] for s in steps], label="total")
    ax.plot(steps, [by_step[s]["mlm_loss"] for s in steps], label="masked LM")
    ax.plot(steps, [by_step[s]["nsp_loss"] for s in steps], label="next sentence")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("bertforge demo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
