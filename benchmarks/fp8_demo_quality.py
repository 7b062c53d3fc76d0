"""Does a model pretrained with FP8 GEMMs (`--fp8`) end as useful as one pretrained in bf16?

The demo's chain at its scale on one corpus, vocabulary and shards: `bertforge demo
--precision bf16` into DIR (its recipe trains at ZeRO stage 2: DeepSpeed's bf16 weights), then
the demo's training again at ZeRO stage 0, the fast path FP8 needs (fp32 weights under bf16
autocast), once with bf16 GEMMs and once with `--fp8` (the demo's seed, steps, batch and
workers), each evaluated, exported and fine-tuned on SST-2 with the demo's budget. Prints and
writes (DIR/fp8_quality.{json,md}) each one's last training loss, masked-LM and next-sentence
accuracy on the validation split, and SST-2 dev accuracy. Needs bf16 arithmetic: a GPU, or a
CPU with AVX512-BF16 or AMX (elsewhere bf16 is emulated, ~9x slower). One seed at the demo's
scale: a sanity check of end quality, not a measurement of FP8's effect on BERT-large
(benchmarks/gpu_parity.py --fp8 is that).

    python3 benchmarks/fp8_demo_quality.py --output /tmp/fp8-demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bertforge.cluster.commands.stages import export_final, train_to_the_end
from bertforge.cluster.demo.config import DemoConfig, DemoPaths
from bertforge.cluster.demo.run import run_demo
from bertforge.cluster.demo.sst2 import finetune_sst2
from bertforge.cluster.demo.summary import training_statistics
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.training.checkpoint import latest_checkpoint
from bertforge.training.eval_options import EvalOptions
from bertforge.training.evaluate import evaluate_checkpoint
from bertforge.training.metrics import read_metrics
from bertforge.training.recipes import demo_recipe


def chain_at_stage_0(demo: DemoConfig, name: str, fp8: bool) -> dict:
    """The demo's train, eval, export and SST-2 stages again at ZeRO stage 0, into DIR/name."""
    paths = DemoPaths(demo.output)
    root = os.path.join(paths.root, name)
    run_dir, hf_dir = os.path.join(root, "run"), os.path.join(root, "hf")
    cfg = demo_recipe(paths.shards, run_dir, max_steps=demo.max_steps,
                      micro_batch_size=demo.micro_batch_size,
                      learning_rate=demo.learning_rate, seed=demo.seed,
                      precision=demo.precision, zero_stage=0, fp8=fp8)
    train_to_the_end(cfg, LaunchConfig(workers=demo.train_workers), name)
    evaluation = evaluate_checkpoint(latest_checkpoint(run_dir), paths.shards,
                                     EvalOptions(seed=demo.seed)).to_dict()
    export_final(run_dir, hf_dir)
    sst2 = finetune_sst2(hf_dir, os.path.join(root, "finetune"), demo.glue_dir,
                         demo.finetune_budget())
    return {"run": run_dir, "eval": evaluation, "sst2": sst2}


def outcome(run_dir: str, evaluation: dict, sst2: dict) -> dict:
    # The demo's own reading of a run's metrics (a resumed run relogs steps).
    last_loss = training_statistics(read_metrics(run_dir))["loss_last"]
    return {"last_loss": last_loss, "mlm_accuracy": evaluation["mlm_accuracy"],
            "nsp_accuracy": evaluation["nsp_accuracy"],
            "sst2_dev_accuracy": sst2["pretrained"]["accuracy"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="the demo's directory")
    args = parser.parse_args(argv)
    demo = DemoConfig(output=args.output, precision="bf16")
    run_demo(demo)
    paths = DemoPaths(demo.output)
    with open(paths.eval, encoding="utf-8") as f:
        bf16_eval = json.load(f)
    with open(paths.summary, encoding="utf-8") as f:
        bf16_sst2 = json.load(f)["finetune_sst2"]
    bf16 = chain_at_stage_0(demo, "stage0-bf16", fp8=False)
    fp8 = chain_at_stage_0(demo, "stage0-fp8", fp8=True)
    rows = {"the demo's recipe (ZeRO 2: DeepSpeed's bf16 weights)":
            outcome(paths.run, bf16_eval, bf16_sst2),
            "ZeRO 0, bf16 GEMMs (the fast path)": outcome(bf16["run"], bf16["eval"], bf16["sst2"]),
            "ZeRO 0, FP8 GEMMs (--fp8)": outcome(fp8["run"], fp8["eval"], fp8["sst2"])}
    lines = ["| pretraining | last loss | MLM accuracy | NSP accuracy | SST-2 dev accuracy |",
             "|---|---:|---:|---:|---:|",
             *(f"| {name} | {r['last_loss']:.4f} | {r['mlm_accuracy']:.4f} | "
               f"{r['nsp_accuracy']:.4f} | {r['sst2_dev_accuracy']:.4f} |"
               for name, r in rows.items())]
    print("\n".join(lines), flush=True)
    with open(os.path.join(paths.root, "fp8_quality.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(paths.root, "fp8_quality.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
