"""Two-phase recipes and warm starts: phase 2 begins from phase 1's weights, and only them."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

from bertforge.pipelines.contract.manifest import read_manifest
from bertforge.training import checkpoint, recipes
from bertforge.training.data import PretrainingLoader
from bertforge.training.export import export_checkpoint, exported_source
from bertforge.training.hf_interop import OPTIONAL_PARTS
from bertforge.training.loop import train
from bertforge.training.metrics import read_metrics
from bertforge.training.model import BertConfig, BertForPreTraining
from bertforge.training.warm_start import load_initial_weights
from tests.training.conftest import write_dataset
from tests.training.test_loop import TINY, config

NO_DROPOUT = {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """Datasets at 64 and 128 tokens (same vocabulary) and a finished phase-1 run."""
    root = tmp_path_factory.mktemp("phases")
    short = write_dataset(str(root / "short"), {"train": [64], "validation": [16]},
                          max_seq_length=64)
    long = write_dataset(str(root / "long"), {"train": [48], "validation": [16]},
                         max_seq_length=128, seed=1)
    run = train(config(short, root / "phase1", model=NO_DROPOUT, zero_stage=1, max_steps=4))
    return short, long, str(root / "phase1"), run.checkpoint_path


@pytest.mark.parametrize("name", ["bert_large", "bert_base"])
def test_full_size_recipes_keep_their_global_batch_on_any_dividing_world(name):
    phase1 = getattr(recipes, f"{name}_phase1")("d", "r")
    phase2 = getattr(recipes, f"{name}_phase2")("d", "r", init_from="r1")
    if name == "bert_large":  # the micro-batch is the device's (decided at start)
        assert phase1.micro_batch_size is None and phase2.micro_batch_size is None
        phase1 = dataclasses.replace(phase1, micro_batch_size=64)
        phase2 = dataclasses.replace(phase2, micro_batch_size=16)
    assert phase1.global_batch(8) == phase1.global_batch(32) == 4096
    assert phase2.global_batch(8) == 2048 and phase2.init_from == "r1"
    # Masked positions per sequence come from the data: 20 at 128 tokens, 80 at 512.
    assert phase1.max_predictions is None and phase2.max_predictions is None
    with pytest.raises(ValueError, match="not a multiple"):
        phase1.accumulation_steps(3)
    assert recipes.bert_base_phase1("d", "r", max_steps=10, warmup_steps=1).max_steps == 10
    # Fewer steps alone keep the recipe's warm-up share (its 3,000 would exceed them).
    assert recipes.bert_base_phase1("d", "r", max_steps=100).warmup_steps == 5  # 3,000/56,250
    assert recipes.bert_large_phase2("d", "r", "i", max_steps=1000).warmup_steps == 100
    assert recipes.bert_tiny_phase1("d", "r", max_steps=1).warmup_steps == 0
    assert recipes.bert_large_phase1("d", "r").warmup_steps == 3_000  # untouched otherwise
    # --grad-accum alone: the accumulation is the user's, the global batch follows from it.
    accumulated = recipes.bert_base_phase1("d", "r", gradient_accumulation_steps=4)
    assert (accumulated.global_batch_size, accumulated.accumulation_steps(1)) == (None, 4)
    assert accumulated.global_batch(2) == 128 * 4 * 2
    both = recipes.bert_base_phase1("d", "r", gradient_accumulation_steps=4,
                                    global_batch_size=1024)
    assert both.accumulation_steps(1) == 8  # a global batch given too: it decides, as --help says


def test_the_micro_batch_of_a_full_size_recipe_follows_the_device_memory():
    def micro(seq_len, memory_gib, *, world_size=1, global_batch_size=4096):
        memory = None if memory_gib is None else int(memory_gib * 2**30)
        return recipes.micro_batch_for_device(seq_len, world_size=world_size,
                                              global_batch_size=global_batch_size,
                                              device_memory_bytes=memory)

    # 512 tokens per GiB, a power of two in all: H100 80 GB (79.2 GiB usable), H200 (140.4).
    assert (micro(128, 79.2), micro(512, 79.2)) == (256, 64)
    assert (micro(128, 140.4), micro(512, 140.4)) == (512, 128)
    assert micro(128, 39.4) == 128  # A100 40 GB
    assert (micro(128, None), micro(512, None)) == (64, 16)  # a CPU: the recipes' old values
    # Never more than a worker's share of the global batch, and always a divisor of it.
    assert micro(128, 140.4, world_size=16) == 256
    assert micro(128, 79.2, global_batch_size=96) == 32
    assert micro(128, 79.2, global_batch_size=None) == 256


def test_demo_recipe_lives_in_recipes():
    assert recipes.demo_recipe("d", "r", max_steps=30).warmup_steps == 3
    assert set(recipes.RECIPES) >= {"bert_large_phase1", "bert_large_phase2", "demo"}
    # `bertforge train --recipe demo` passes resume (and any flag given) as an override.
    cfg = recipes.recipe_by_name("demo", "d", "r", resume=False, max_steps=50, eval_every=10)
    assert (cfg.resume, cfg.max_steps, cfg.eval_every, cfg.precision) == (False, 50, 10, "auto")


def test_recipes_say_only_where_they_depart_from_the_configs_defaults():
    """A default said twice drifts: the recipes restated seven of EngineConfig's."""
    from bertforge.training.config import TrainConfig

    declared = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(TrainConfig)
                if (f.default, f.default_factory) != (dataclasses.MISSING,) * 2}
    for name in ("FULL_SIZE_SETTINGS", "DEMO_TRAINING"):
        restated = [key for key, value in getattr(recipes, name).items()
                    if key in declared and declared[key] == value]
        assert not restated, f"recipes.{name} restates the default of {restated}"
    assert recipes.bert_tiny_phase1("d", "r").precision == declared["precision"] == "auto"


def first_batch(data_dir: str, cfg) -> dict[str, torch.Tensor]:
    loader = PretrainingLoader(data_dir, "train", batch_size=cfg.micro_batch_size,
                               seed=cfg.seed, prefetch=0)
    return next(iter(loader))


def test_phase2_starts_from_phase1_weights_with_a_fresh_optimizer(phases, tmp_path):
    _, long, phase1_dir, phase1_ckpt = phases
    cfg = recipes.bert_tiny_phase2(long, str(tmp_path / "phase2"), init_from=phase1_dir,
                                   model=NO_DROPOUT, precision="fp32", max_steps=2,
                                   warmup_steps=2, log_every=1)
    train(cfg)
    # The first logged loss is the phase-1 model's on phase 2's first (128-token) batch.
    model, _ = checkpoint.load_model(phase1_ckpt)
    with torch.no_grad():
        expected = model(**first_batch(long, cfg)).loss.item()
    history = [r for r in read_metrics(cfg.run_dir) if "loss" in r]
    assert history[0]["loss"] == pytest.approx(expected, rel=1e-5)
    # A new schedule: step 1 of 2 warm-up steps trains at half the peak (phase 1 ended at 0),
    # and step 2 at the peak. (The logged rate was the next step's: the peak, then 0.)
    assert [record["lr"] for record in history] == pytest.approx(
        [cfg.learning_rate / 2, cfg.learning_rate])
    with open(os.path.join(cfg.run_dir, "config.json")) as f:
        assert phase1_dir in f.read()
    # Its export says which phase-1 checkpoint it grew from.
    lineage = exported_source(export_checkpoint(cfg.run_dir, str(tmp_path / "hf")))["warm_start"]
    assert lineage["checkpoint"] == phase1_ckpt and lineage["init_from"] == phase1_dir


def test_an_export_records_the_warm_start_its_run_grew_from(phases, tmp_path):
    """A phase-2 model exported to Hugging Face said which checkpoint it was (run, step) but not
    which phase-1 checkpoint gave that run its first weights: its checkpoints' bertforge.json
    holds it (`warm_start`), its export's `bertforge_source` now too; None from scratch."""
    _, _, phase1_dir, phase1_ckpt = phases
    assert exported_source(export_checkpoint(phase1_dir, str(tmp_path / "p1")))[
        "warm_start"] is None
    phase2 = tmp_path / "phase2" / "checkpoints" / os.path.basename(phase1_ckpt)
    shutil.copytree(phase1_ckpt, phase2)  # as if a phase 2 warm-started from phase 1 saved it
    record = {"init_from": phase1_dir, "checkpoint": phase1_ckpt,
              "global_step": checkpoint.read_metadata(phase1_ckpt)["global_step"],
              "run_id": checkpoint.read_metadata(phase1_ckpt)["run_id"]}
    metadata_path = phase2 / checkpoint.METADATA_NAME
    metadata = json.loads(metadata_path.read_text())
    metadata_path.write_text(json.dumps({**metadata, "warm_start": record}))
    source = exported_source(export_checkpoint(str(tmp_path / "phase2"), str(tmp_path / "hf")))
    assert source["warm_start"] == record
    assert source["checkpoint"] == str(phase2) and source["run_id"] == record["run_id"]


def test_warm_start_from_a_hugging_face_directory(phases, tmp_path):
    short, _, _, phase1_ckpt = phases
    hf_dir = export_checkpoint(phase1_ckpt, str(tmp_path / "hf"))
    source, _ = checkpoint.load_model(phase1_ckpt)
    model = BertForPreTraining(source.config)
    load_initial_weights(model, hf_dir, read_manifest(short).tokenizer.vocab_sha256)
    reference = source.state_dict()
    assert all(torch.equal(p, reference[n]) for n, p in model.state_dict().items())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_warm_start_checks_the_vocabulary_of_a_tokenizer_json_only_directory(phases, tmp_path):
    """transformers 5 saves a tokenizer.json and no vocab.txt: such a source was taken with no
    vocabulary check at all. Its WordPiece vocabulary is now the one compared with the data's."""
    short, _, _, phase1_ckpt = phases
    hf_dir = export_checkpoint(phase1_ckpt, str(tmp_path / "hf"))
    os.remove(os.path.join(hf_dir, "vocab.txt"))
    source, _ = checkpoint.load_model(phase1_ckpt)
    sha = read_manifest(short).tokenizer.vocab_sha256
    load_initial_weights(BertForPreTraining(source.config), hf_dir, sha)  # the same: taken
    with pytest.raises(ValueError, match="another vocabulary than the training data"):
        load_initial_weights(BertForPreTraining(source.config), hf_dir, "0" * 64)


@pytest.mark.parametrize("kind", ["BertModel", "BertForSequenceClassification",
                                  "BertForMaskedLM"])
def test_warm_start_from_a_hugging_face_bert_of_another_head(phases, tmp_path, kind):
    """A BertModel's directory, or the `hf/` a fine-tune writes: the run crashed in its
    workers ("state dict does not match: missing cls.*"), retried four times. Now the encoder
    (and whatever head the source has of pretraining's) comes from it, the rest keeps the
    model's own initialisation, and `lacking` names that rest."""
    import transformers

    short, _, _, phase1_ckpt = phases
    full = transformers.BertForPreTraining.from_pretrained(
        export_checkpoint(phase1_ckpt, str(tmp_path / "hf")))
    other = getattr(transformers, kind)(full.config)
    other.load_state_dict(full.state_dict(), strict=False)  # the names they share
    if kind == "BertModel":
        other = full.bert
    other.save_pretrained(tmp_path / kind)
    shutil.copy(tmp_path / "hf" / "vocab.txt", tmp_path / kind)

    source, _ = checkpoint.load_model(phase1_ckpt)
    torch.manual_seed(0)
    model = BertForPreTraining(source.config)
    fresh = {n: p.clone() for n, p in model.state_dict().items()}
    initial = load_initial_weights(model, str(tmp_path / kind),
                                   read_manifest(short).tokenizer.vocab_sha256)
    lacking = {"BertModel": ("masked-LM head", "next-sentence head"),
               "BertForSequenceClassification": ("masked-LM head", "next-sentence head"),
               "BertForMaskedLM": ("pooler", "next-sentence head")}[kind]
    assert initial.lacking == lacking
    prefixes = tuple(OPTIONAL_PARTS[part] for part in lacking)
    reference = source.state_dict()
    for name, tensor in model.state_dict().items():
        # The decoder's weight is the word embeddings' (tied): the source's.
        from_source = name == "cls.predictions.decoder.weight" or not name.startswith(prefixes)
        expected = reference[name] if from_source else fresh[name]
        assert torch.equal(tensor, expected), name
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_a_resumed_run_says_init_from_is_not_used_and_keeps_its_own_record(phases, tmp_path,
                                                                            capsys):
    """--init-from on a run that resumes was dropped without a word, and config.json then
    named it as the run's start: the run had started from random weights."""
    short, _, phase1_dir, phase1_ckpt = phases
    run_dir = tmp_path / "run"
    shutil.copytree(phase1_dir, run_dir)
    hf_dir = export_checkpoint(phase1_ckpt, str(tmp_path / "hf"))
    capsys.readouterr()
    train(config(short, run_dir, model=NO_DROPOUT, zero_stage=1, max_steps=4, init_from=hf_dir))
    assert (f"--init-from {hf_dir} not used: the run resumes from its own checkpoint "
            in capsys.readouterr().out)
    with open(run_dir / "config.json") as f:
        assert json.load(f)["train"]["init_from"] is None


def test_warm_start_refuses_another_architecture_or_a_non_checkpoint(phases, tmp_path):
    short, _, phase1_dir, phase1_ckpt = phases
    sha = read_manifest(short).tokenizer.vocab_sha256
    config_ = BertConfig(**{**checkpoint.read_metadata(phase1_ckpt)["model_config"],
                            "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="another architecture.*num_hidden_layers 2 != 3"):
        load_initial_weights(BertForPreTraining(config_), phase1_dir, sha)
    with pytest.raises(ValueError, match="neither a complete checkpoint"):
        load_initial_weights(BertForPreTraining(config_), str(tmp_path), sha)


def test_data_longer_than_the_position_table_is_a_clear_error(phases, tmp_path):
    _, long, _, _ = phases
    model = {**TINY, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match="up to 128 tokens.*max_position_embeddings=64: give "
                       "data prepared at --max-seq-length 64 or less, or a model with more"):
        train(config(long, tmp_path / "run", model=model))
