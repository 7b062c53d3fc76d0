"""`bertforge demo`: the whole chain on the built-in corpus, through the real engines.

corpus (docstrings) -> WordPiece vocab -> Beam prepare (DirectRunner, 2 processes) ->
Ray Train + DeepSpeed ZeRO-2 (2 CPU workers; bf16 where the CPU has it natively, else fp32) ->
evaluation -> Hugging Face export -> SST-2
fine-tuned from it and from random init, beside a bag-of-words baseline -> summary.

Each stage leaves a completion record in DIR; a second run into the same DIR reuses finished
stages, resumes training from its newest checkpoint, and refuses a DIR made with other settings.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any

from bertforge.cluster.demo_finetune import (
    FinetuneBudget,
    check_shipped_budget,
    finetune_done,
    finetune_sst2,
    summary_rows,
)
from bertforge.cluster.stage_runner import Stage, StageRunner, fresh_dir
from bertforge.pipelines.config_fields import RERUN_MAY_CHANGE, option, without_marked
from bertforge.training.engine_config import engine_option
from bertforge.training.metrics import read_metrics

DEFAULT_DEMO_DIR = "bertforge-demo"


@dataclass
class DemoConfig:
    """The demo's settings; `bertforge demo` flags are generated from these fields."""

    output: str = option(DEFAULT_DEMO_DIR, "directory for every output of the demo",
                         marks=(RERUN_MAY_CHANGE,))
    corpus_mb: float = option(4.0, "megabytes of docstring prose to gather")
    vocab_size: int = option(8192, "WordPiece vocabulary size")
    max_seq_length: int = option(128, "tokens per instance")
    dupe_factor: int = option(2, "passes over each document in prepare")
    num_shards: int = option(4, "train shards")
    prepare_workers: int = option(2, "Beam worker processes")
    train_workers: int = option(2, "Ray Train workers")
    # 540 steps x 32 sequences of 128 tokens = ~0.8 epoch of the ~21,900 training pairs, in
    # fp32 on a CPU without native bf16: 0.26 s a step on 2 AVX2 cores, so the whole demo fits
    # in five minutes there (4 min 41 s measured). Measured: MLM accuracy 0.120 (baseline 0.066),
    # NSP 0.632; 600 steps: 0.119-0.125, 0.623; 800: 0.132, 0.630. This model seems to need
    # updates more than sequences: 1,000 x 64 took ~330 s and left the unigram plateau later;
    # 1,000 x 16 reached MLM 0.124 but fine-tuned worse (SST-2 0.591), as did 800 x 32 of 64
    # tokens (0.557). 1e-3 beat 5e-4 (MLM 0.122 vs 0.102 after 600 steps) and 2e-3 (0.080
    # after 300).
    max_steps: int = option(540, "training steps", aliases=("--steps",))
    micro_batch_size: int = option(16, "sequences per worker per step (x 2 workers = 32)")
    learning_rate: float = option(1e-3, "peak learning rate")
    seed: int = option(12345, "data, masking and initialisation")
    # auto: fp32 on a CPU without native bf16, where emulated bf16 is ~60x slower per matmul.
    precision: str = engine_option("precision")
    # After the export: SST-2 fine-tuned from this model and from random weights, same budget
    # (cluster/demo_finetune.py). A subset of the train set keeps both within ~75 s.
    finetune_train_examples: int = option(2000, "SST-2 train sentences for the fine-tuning "
                                           "comparison (a fixed subset of 67,349; 0 skips it)")
    # SST-2's train set is mostly short phrases (9 words on average, dev sentences 20): from
    # 2,000 random phrases neither model learned reliably (0.51-0.65 over seeds, random init at
    # chance); from 2,000 of its 25,152 lines of 10 words or more the pretrained one did.
    finetune_min_words: int = option(10, "SST-2 train lines of at least this many words only "
                                      "(before the subset; 0: every line)")
    finetune_dev_examples: int | None = option(None, "SST-2 dev sentences scored (default: "
                                                "all 872)")
    finetune_epochs: float = option(2.0, "fine-tuning epochs over those sentences")
    # 48 cuts few dev sentences (20 words on average) and saved ~5 s over 64.
    finetune_max_seq_length: int = option(48, "fine-tuning tokens per sentence")
    # 16 (250 steps) learned where 32 (124 steps) often stayed at chance from either model.
    finetune_batch_size: int = option(16, "fine-tuning sentences per step")
    # 1e-4 underfit in 250 steps (train loss 0.67, dev 0.585 from the demo's model); 3e-4 suits a
    # 2-layer model (1e-3 stayed at chance), as 1e-3 does its pretraining.
    finetune_learning_rate: float = option(3e-4, "fine-tuning peak learning rate")
    # Where SST-2 is read from: the shipped subset is GLUE's own lines of the default draw.
    glue_dir: str | None = option(None, "GLUE data holding SST-2/train.tsv and dev.tsv "
                                  "(default: the 2,000-line SST-2 subset shipped with "
                                  "bertforge, enough for the default budget)",
                                  marks=(RERUN_MAY_CHANGE,))

    def __post_init__(self) -> None:
        if self.corpus_mb < 0.1:
            raise ValueError("the demo corpus needs at least 0.1 MB (100,000 bytes)")
        if self.max_steps < 10:
            raise ValueError("the demo needs at least 10 training steps")
        if self.glue_dir is None and self.finetune_train_examples:
            check_shipped_budget(self.finetune_train_examples, self.finetune_min_words)

    def settings(self) -> dict[str, Any]:
        """What must match for a second run to reuse the first one's stages."""
        return without_marked(asdict(self), DemoConfig, RERUN_MAY_CHANGE)


class DemoPaths:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.corpus = os.path.join(self.root, "corpus", "docstrings.jsonl")
        self.vocab_dir = os.path.join(self.root, "vocab")
        self.shards = os.path.join(self.root, "shards")
        self.run = os.path.join(self.root, "run")
        self.hf = os.path.join(self.root, "hf")
        self.eval = os.path.join(self.root, "eval.json")
        self.summary = os.path.join(self.root, "summary.json")
        self.loss_curve = os.path.join(self.root, "loss_curve.png")
        self.finetune = os.path.join(self.root, "finetune")


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run (or finish) the demo in config.output; returns the summary."""
    paths = DemoPaths(config.output)
    started = time.time()
    with StageRunner(paths.root, "demo", config.settings(), heartbeat_seconds=20.0,
                     skip_message="done in an earlier run, reusing it",
                     dir_flag="--output") as runner:
        runner.run([
            Stage("corpus", lambda: _build_corpus(paths, config)),
            Stage("vocab", lambda: _train_vocab(paths, config)),
            Stage("prepare", lambda: _prepare(paths, config)),
            Stage("train", lambda: _train(paths, config)),
            Stage("eval", lambda: _evaluate(paths, config)),
            Stage("export", lambda: _export(paths)),
            # A run that found no SST-2 data tries again next time.
            Stage("finetune", lambda: _finetune(paths, config),
                  is_done=lambda: finetune_done(runner.recorded("finetune"))),
        ])
        summary = _summarise(paths, runner.state, time.time() - started)
    return summary


# --- stages -------------------------------------------------------------------------------


def _build_corpus(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.pipelines.docstring_corpus import write_docstring_corpus

    os.makedirs(os.path.dirname(paths.corpus), exist_ok=True)
    stats = write_docstring_corpus(paths.corpus, target_bytes=int(config.corpus_mb * 1e6))
    print(f"[demo] corpus: {stats['num_documents']} documents, {stats['num_bytes']:,} bytes "
          f"of docstrings", flush=True)
    return {"num_documents": stats["num_documents"], "num_bytes": stats["num_bytes"]}


def _train_vocab(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.pipelines.vocab import train_wordpiece_vocab

    fresh_dir(paths.vocab_dir)
    path = train_wordpiece_vocab(
        [paths.corpus], paths.vocab_dir, vocab_size=config.vocab_size, lower_case=True
    )
    return {"vocab": path}


def _prepare(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.pipelines.prepare import run as run_prepare
    from bertforge.pipelines.prepare_options import PrepareConfig

    fresh_dir(paths.shards)  # a crashed earlier attempt leaves no manifest; start over
    prepare = PrepareConfig(
        inputs=(paths.corpus,), output=paths.shards,
        vocab=os.path.join(paths.vocab_dir, "vocab.txt"), max_seq_length=config.max_seq_length,
        dupe_factor=config.dupe_factor, num_shards=config.num_shards, seed=config.seed,
    )
    counts = run_prepare(prepare, [f"--direct_num_workers={config.prepare_workers}",
                                   "--direct_running_mode=multi_processing"])
    return {"counts": counts}


def _train(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.cluster.ray_train import LaunchConfig, train_on_ray
    from bertforge.training.recipes import demo_recipe

    cfg = demo_recipe(
        paths.shards, paths.run, max_steps=config.max_steps,
        micro_batch_size=config.micro_batch_size, learning_rate=config.learning_rate,
        seed=config.seed, precision=config.precision,
    )
    step = train_on_ray(cfg, LaunchConfig(workers=config.train_workers)).get("step")
    if step != config.max_steps:
        raise RuntimeError(f"training stopped at step {step}, not {config.max_steps}")
    # Losses and throughput come from metrics.jsonl, which spans resumed runs too.
    return training_statistics(read_metrics(paths.run))


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


def _evaluate(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.training.checkpoint import latest_checkpoint
    from bertforge.training.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(latest_checkpoint(paths.run), paths.shards, seed=config.seed)
    with open(paths.eval, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2)
    return result.to_dict()


def _export(paths: DemoPaths) -> dict[str, Any]:
    from bertforge.training.export import export_checkpoint

    shutil.rmtree(paths.hf, ignore_errors=True)  # ours: left by a run that died before recording
    export_checkpoint(paths.run, paths.hf)
    return {"hf_dir": paths.hf, "verified_with_transformers": _verify_with_transformers(paths.hf)}


def _verify_with_transformers(hf_dir: str) -> bool:
    """Load the export the way users will; transformers is a dev extra, so it may be absent."""
    try:
        from transformers import BertForPreTraining, BertTokenizerFast
    except ImportError:
        print("[demo] export: transformers not installed, skipping the load check", flush=True)
        return False
    BertForPreTraining.from_pretrained(hf_dir)
    BertTokenizerFast.from_pretrained(hf_dir)
    print(f"[demo] export: {hf_dir} loads in transformers.BertForPreTraining", flush=True)
    return True


def _finetune(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    if config.finetune_train_examples == 0:
        return {"skipped": "fine-tuning skipped (--finetune-train-examples 0)"}
    budget = FinetuneBudget(
        train_examples=config.finetune_train_examples, min_words=config.finetune_min_words,
        dev_examples=config.finetune_dev_examples,
        epochs=config.finetune_epochs, max_seq_length=config.finetune_max_seq_length,
        batch_size=config.finetune_batch_size, learning_rate=config.finetune_learning_rate,
        # One worker on every core: two on one machine pay an all-reduce and ZeRO's wrapper
        # every step (1.55x the time on the demo's model: benchmarks/finetune_vs_plain_loop.py).
        seed=config.seed, workers=1,
    )
    return finetune_sst2(paths.hf, paths.finetune, config.glue_dir, budget)


# --- summary ------------------------------------------------------------------------------


def _summarise(paths: DemoPaths, state: dict[str, Any], seconds_now: float) -> dict[str, Any]:
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
        "instances": stages["prepare"]["counts"].get("instances"),
        "hf_dir": paths.hf,
        "loss_curve": paths.loss_curve,
        "finetune_sst2": stages["finetune"],
    }
    _plot_loss_curve(read_metrics(paths.run), paths.loss_curve)
    with open(paths.summary, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(format_summary(summary), flush=True)
    return summary


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
