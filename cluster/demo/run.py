"""`bertforge demo`: the demo's stages on the stage runner, in DIR.

The chain's stages (vocab, prepare, train, export) are `bertforge pipeline`'s own bodies
(`cluster.commands.stages`) on the demo's settings and layout; corpus, eval and the SST-2
fine-tuning are the demo's alone. Each stage is done once DIR's state file records it (the
summary reads those records); a second run into the same DIR reuses finished stages, resumes
training from its newest checkpoint, and refuses a DIR made with other settings.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from bertforge.cluster.commands.stage_runner import Stage, StageRunner
from bertforge.cluster.commands.stages import (
    export_final,
    make_vocab,
    prepare_dataset,
    train_to_the_end,
)
from bertforge.cluster.demo.config import DemoConfig, DemoPaths
from bertforge.cluster.demo.sst2 import finetune_done, finetune_sst2
from bertforge.cluster.demo.summary import summarise, training_statistics

if TYPE_CHECKING:  # imported where used: Beam loads only for the prepare stage
    from bertforge.pipelines.prepare_options import PrepareConfig
    from bertforge.pipelines.vocab_options import VocabConfig


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run (or finish) the demo in config.output; returns the summary."""
    paths = DemoPaths(config.output)
    started = time.time()
    with StageRunner(paths.root, "demo", config.settings(), heartbeat_seconds=20.0,
                     skip_message="done in an earlier run, reusing it",
                     dir_flag="--output") as runner:
        runner.run([
            Stage("corpus", lambda: _build_corpus(paths, config)),
            Stage("vocab", lambda: make_vocab(_vocab_config(paths, config))),
            Stage("prepare", lambda: prepare_dataset(_prepare_config(paths, config),
                                                     _beam_args(config))),
            Stage("train", lambda: _train(paths, config)),
            Stage("eval", lambda: _evaluate(paths, config)),
            Stage("export", lambda: _export(paths)),
            # A run that found no SST-2 data tries again next time.
            Stage("finetune", lambda: _finetune(paths, config),
                  is_done=lambda: finetune_done(runner.recorded("finetune"))),
        ])
        summary = summarise(paths, runner.state, time.time() - started)
    return summary


def _build_corpus(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.cluster.demo.docstring_corpus import write_docstring_corpus

    os.makedirs(os.path.dirname(paths.corpus), exist_ok=True)
    stats = write_docstring_corpus(paths.corpus, target_bytes=int(config.corpus_mb * 1e6))
    print(f"[demo] corpus: {stats['num_documents']} documents, {stats['num_bytes']:,} bytes "
          f"of docstrings", flush=True)
    return {"num_documents": stats["num_documents"], "num_bytes": stats["num_bytes"]}


def _vocab_config(paths: DemoPaths, config: DemoConfig) -> VocabConfig:
    from bertforge.pipelines.vocab_options import VocabConfig

    return VocabConfig(inputs=(paths.corpus,), output=paths.vocab_dir,
                       vocab_size=config.vocab_size)


def _prepare_config(paths: DemoPaths, config: DemoConfig) -> PrepareConfig:
    from bertforge.pipelines.prepare_options import PrepareConfig

    return PrepareConfig(
        inputs=(paths.corpus,), output=paths.shards, vocab=paths.vocab,
        max_seq_length=config.max_seq_length, dupe_factor=config.dupe_factor,
        num_shards=config.num_shards, seed=config.seed,
    )


def _beam_args(config: DemoConfig) -> list[str]:
    from bertforge.pipelines.local.options import local_processes

    return local_processes(config.prepare_workers)


def _train(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.cluster.launch.launch_config import LaunchConfig
    from bertforge.training.metrics import read_metrics
    from bertforge.training.recipes import demo_recipe

    cfg = demo_recipe(
        paths.shards, paths.run, max_steps=config.max_steps,
        micro_batch_size=config.micro_batch_size, learning_rate=config.learning_rate,
        seed=config.seed, precision=config.precision,
    )  # the recipe's model and ZeRO stage; warm-up and logging follow the steps
    record = train_to_the_end(cfg, LaunchConfig(workers=config.train_workers), "demo")
    # Losses and throughput come from metrics.jsonl, which spans resumed runs too.
    return {**record, **training_statistics(read_metrics(paths.run))}


def _evaluate(paths: DemoPaths, config: DemoConfig) -> dict[str, Any]:
    from bertforge.training.checkpoint import latest_checkpoint
    from bertforge.training.eval_options import EvalOptions
    from bertforge.training.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(latest_checkpoint(paths.run), paths.shards,
                                 EvalOptions(seed=config.seed))
    with open(paths.eval, "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f, indent=2)
    return result.to_dict()


def _export(paths: DemoPaths) -> dict[str, Any]:
    record = export_final(paths.run, paths.hf)
    return {**record, "verified_with_transformers": _verify_with_transformers(paths.hf)}


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
    return finetune_sst2(paths.hf, paths.finetune, config.glue_dir, config.finetune_budget())
