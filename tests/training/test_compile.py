"""`compile`: torch.compile in the loop itself, the model without graph breaks, each encoder
layer compiled (two graphs whatever the depth), plain names."""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from bertforge.training import checkpoint
from bertforge.training.model import BertConfig, BertForPreTraining
from tests.training.test_model import random_batch


def _graph_breaks(model, batch) -> tuple[int, list[str]]:
    explanation = torch._dynamo.explain(model)(**batch)
    return explanation.graph_break_count, [str(b.reason) for b in explanation.break_reasons]


@pytest.mark.parametrize("mode", ["train", "eval", "bf16", "unpadded"])
def test_the_model_traces_as_one_graph(mode):
    """What `compile` wraps: a padded pair batch with labels through the sparse head (fixed
    max_predictions), in training and evaluation, fp32 and bf16 weights: no graph break.
    On the CPU the eager fast paths (oneDNN linear, lane dropout, the all-ones mask check)
    step aside under tracing; on a GPU they are not taken at all."""
    torch.manual_seed(0)
    config = BertConfig(99, 32, 2, 2, 64)
    model = BertForPreTraining(config)
    model.max_predictions = 20
    batch = random_batch(config, batch_size=4, seq_len=20)
    if mode == "eval":
        model.eval()
    elif mode == "bf16":
        model = model.bfloat16()
    elif mode == "unpadded":
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    count, reasons = _graph_breaks(model, batch)
    assert count == 0, reasons


@pytest.mark.slow
def test_compile_in_the_loop_follows_eager_without_graph_breaks_and_keeps_plain_names(tmp_path):
    """`--compile` in the real loop (fp32, no dropout so that both runs draw nothing): the
    eager run's losses to rounding, no graph break, two graphs (the layers, the last layer) over
    8 steps of varying batch width, and checkpoints and exports with plain parameter names.

    Shapes are dynamic from the first step here (`assume_static_by_default=False`). By default
    torch compiles a static graph first and, at the next width, one with a dynamic width: the
    same graph in the end, compiled twice (this test with a cold inductor cache, as on CI, on 2
    AVX2 cores: 139 CPU-seconds that way, 101 this way). One graph still shows any guard on a
    value of ours that changes from step to step: each such change would compile another."""
    from bertforge.training.export import export_checkpoint
    from bertforge.training.loop import train
    from bertforge.training.metrics import read_metrics
    from tests.training.conftest import write_dataset
    from tests.training.test_loop import TINY, config

    data = write_dataset(str(tmp_path / "data"), {"train": [96]}, max_seq_length=64)
    no_dropout = {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    common = dict(model=no_dropout, precision="fp32", zero_stage=0, max_steps=8,
                  learning_rate=3e-3)
    train(config(data, tmp_path / "eager", **common))
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(assume_static_by_default=False):
        run = train(config(data, tmp_path / "compiled", compile=True, **common))

    def losses(run_dir) -> list[float]:
        return [r["loss"] for r in read_metrics(str(run_dir)) if "loss" in r]

    assert len(losses(tmp_path / "compiled")) == 8
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)
    assert dict(counters["graph_break"]) == {}
    # Each encoder layer is compiled (training.engine.compile_model): one graph serves every
    # layer but the last, which runs on the heads' rows only and has its own. Batches are
    # padded to their longest row, so widths vary: still two graphs, not a recompilation per
    # step.
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # nn.Module.compile works in place: no `_orig_mod.` in the checkpoint or the export.
    states = torch.load(os.path.join(run.checkpoint_path, "mp_rank_00_model_states.pt"),
                        weights_only=False)
    assert states["module"] and not any("_orig_mod" in name for name in states["module"])
    checkpoint.load_model(run.checkpoint_path)  # strict names
    export_checkpoint(run.checkpoint_path, str(tmp_path / "hf"))
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_each_layer_compiles_with_the_engines_inductor_options(monkeypatch, device):
    """training.engine.compile_model hands every encoder layer the engine's inductor options:
    on a GPU dropout's masks from ATen's own kernel (`fallback_random`, measured faster on an
    H200), on a CPU inductor's defaults. Recorded, not compiled: no GPU here."""
    import types

    from bertforge.training import engine as engine_module
    from bertforge.training.engine_config import EngineConfig
    from bertforge.training.model import BertLayer

    compiled = []
    monkeypatch.setattr(BertLayer, "compile", lambda self, **kwargs: compiled.append(kwargs))
    model = BertForPreTraining(BertConfig(99, 32, 3, 2, 64))
    engine = types.SimpleNamespace(device=torch.device(device))
    cfg = EngineConfig(max_steps=1, learning_rate=1e-4, warmup_steps=0, micro_batch_size=2,
                       zero_stage=0, compile=True)
    engine_module.compile_model(engine, model, cfg)
    expected = {"fallback_random": True} if device == "cuda" else None
    assert compiled == [{"options": expected}] * 3
