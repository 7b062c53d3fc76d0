"""FinetuneConfig, its flags, data defaults, the data order and the sweep's summary: pure."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from bertforge.cluster.cli import build_parser
from bertforge.cluster.commands.finetune_sweep import (
    data_note,
    resolve_data_files,
    summary_line,
    sweep_statistics,
)
from bertforge.cluster.launch.launch_config import FOR_CHECKPOINTS, LaunchConfig
from bertforge.pipelines.contract.config_fields import given_values, marked
from bertforge.training.finetune.config import FinetuneConfig
from bertforge.training.finetune.loop import batch_indices, count_steps
from bertforge.training.finetune.task_data import subsample

REQUIRED = {"task": "sst2", "model": "m", "output": "o"}


def parse(*argv: str):
    return build_parser().parse_args(["finetune", *argv])


def test_every_field_has_help_and_a_finetune_flag():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    dests = {a.dest for a in commands.choices["finetune"]._actions}
    for cls in (FinetuneConfig, LaunchConfig):
        for f in dataclasses.fields(cls):
            assert cls is LaunchConfig or f.metadata.get("help"), f.name
            # A fine-tuning run keeps no checkpoints: no flag for where they persist.
            assert (f.name in dests) != marked(f, FOR_CHECKPOINTS), \
                f"{cls.__name__}.{f.name}: a flag exactly where not for checkpoints"


def test_finetune_help_says_what_its_flags_do():
    """--max-failures said "restarts from the newest checkpoint" (fine-tuning keeps none: the
    unfinished run starts again), and --batch-size "examples" where SQuAD's are windows."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    helps = {a.dest: a.help for a in commands.choices["finetune"]._actions}
    assert "finetune and glue start the unfinished run again" in helps["max_failures"]
    assert "squad: context windows" in helps["batch_size"]
    assert "squad: context windows" in helps["eval_batch_size"]


def test_flags_build_the_config_and_defaults_are_the_papers_recipe():
    args = parse("--task", "SST-2", "--model", "m", "--output", "o", "--sweep",
                 "--seeds", "1", "2", "--workers", "3")
    cfg = FinetuneConfig(**given_values(args, FinetuneConfig))
    launch = LaunchConfig(**given_values(args, LaunchConfig, without=(FOR_CHECKPOINTS,)))
    assert cfg.task == "sst2" and launch.workers == 3
    assert (cfg.batch_size, cfg.epochs, cfg.warmup_fraction, cfg.seq_length) == (32, 3, 0.1, 128)
    assert cfg.runs() == [(2e-5, 1), (2e-5, 2), (3e-5, 1), (3e-5, 2), (5e-5, 1), (5e-5, 2)]
    assert FinetuneConfig(**{**REQUIRED, "task": "squad"}).seq_length == 384
    assert FinetuneConfig(**REQUIRED, learning_rate=3e-5).runs() == [(3e-5, 12345)]


def test_settings_leave_out_what_a_rerun_may_change():
    """More seeds or rates reuse the finished runs; another model or recipe does not."""
    base = FinetuneConfig(**REQUIRED)
    more = FinetuneConfig(**{**REQUIRED, "output": "elsewhere"}, seeds=(1, 2, 3), sweep=True)
    assert base.settings() == more.settings()
    assert base.settings() != FinetuneConfig(**REQUIRED, epochs=2).settings()


@pytest.mark.parametrize("values, message", [
    ({"task": "qnli"}, "unknown task 'qnli'"),
    ({"task": "custom"}, "needs --text-columns and --label-column"),
    ({"text_columns": ("a",)}, "are for --task custom"),
    ({"task": "custom", "text_columns": ("a",), "label_column": "b", "train": "t", "dev": "d",
      "regression": True, "labels": ("x", "y")}, "--regression takes no --labels"),
    ({"seeds": ()}, "at least one seed"),
    ({"batch_size": 0}, "batch_size must be at least 1"),
    # SQuAD's window against its length: found by the worker before, naming no flag.
    ({"task": "squad", "max_seq_length": 128}, "max_seq_length 128 leaves 61 context tokens "
     "after a 64-token question: more than doc_stride 128 are needed; give --doc-stride 30"),
    # A window of one token has no stride shorter than it: refused here, not by the worker.
    ({"task": "squad", "max_seq_length": 68, "doc_stride": 1}, "max_seq_length 68 leaves 1 "
     "context tokens after a 64-token question: a window needs at least 2; give a "
     "--max-seq-length of at least 69"),
    ({"task": "squad", "max_seq_length": 40}, "leaves 0 context tokens"),
    ({"warmup_fraction": 1.0}, "warmup_fraction must be in"),
    # Found by the worker before, after the run had started.
    ({"max_seq_length": 3}, "max_seq_length must be at least 4 "),
    # Another task's options changed nothing but pinned the output ("differs in: doc_stride").
    ({"doc_stride": 64, "max_answer_length": 20}, "^--doc-stride, --max-answer-length are for "
     "--task squad$"),
    ({"has_header": False}, "--no-has-header are for --task custom"),
    ({"task": "custom", "text_columns": ("q",), "label_column": "q", "train": "t", "dev": "d"},
     "--label-column q is also one of --text-columns"),
    ({"model": ""}, "^--model is required$"),
    ({"sweep": True, "sweep_learning_rates": (1e-5, -1.0)}, "learning rates must be positive"),
    # A repeat was the same run reused, counted twice in the median and spread.
    ({"seeds": (1, 2, 1)}, "^--seeds lists 1 twice \\(to 6 digits, which name a run\\): each "
     "value is one run"),
    ({"sweep": True, "sweep_learning_rates": (2e-5, 2e-5)}, "^--sweep-learning-rates lists "
     "2e-05 twice"),
    # Two rates alike in a run's name (lr2e-05-seed1) shared its folder and were counted twice.
    ({"sweep": True, "sweep_learning_rates": (2e-5, 2.0000001e-5)}, "^--sweep-learning-rates "
     "lists 2e-05 twice"),
    # The other mode's rate was trained without a word of the one given.
    ({"sweep": True, "learning_rate": 1e-4}, "^--lr is the rate of a run without --sweep"),
    ({"sweep_learning_rates": (1e-4,)}, "^--sweep-learning-rates are --sweep's rates: add "
     "--sweep"),
    ({"task": "custom", "text_columns": ("s", "s"), "label_column": "l", "train": "t",
      "dev": "d"}, "^--text-columns names s twice"),
])
def test_bad_configs_are_one_clear_error(values, message):
    with pytest.raises(ValueError, match=message):
        FinetuneConfig(**{**REQUIRED, **values})


def test_default_files_come_from_the_data_root(tmp_path):
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "glue" / "SST-2").mkdir(parents=True, exist_ok=True)
        (tmp_path / "glue" / "SST-2" / name).write_text("sentence\tlabel\n")
    (tmp_path / "squad").mkdir()
    (tmp_path / "squad" / "dev-v1.1.json").write_text("{}")
    cfg = resolve_data_files(FinetuneConfig(**REQUIRED, data_root=str(tmp_path)))
    assert cfg.train == str(tmp_path / "glue" / "SST-2" / "train.tsv")
    assert cfg.dev == str(tmp_path / "glue" / "SST-2" / "dev.tsv") and data_note(cfg) is None
    squad = resolve_data_files(FinetuneConfig(**{**REQUIRED, "task": "squad"},
                                              data_root=str(tmp_path)))
    assert squad.train == squad.dev == str(tmp_path / "squad" / "dev-v1.1.json")
    assert "split by article" in data_note(squad)
    with pytest.raises(ValueError, match="no such file"):
        resolve_data_files(FinetuneConfig(**{**REQUIRED, "task": "rte"},
                                          data_root=str(tmp_path)))
    with pytest.raises(ValueError, match="give both --train and --dev"):
        resolve_data_files(FinetuneConfig(**REQUIRED, train="x.tsv", data_root=str(tmp_path)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_worker_count_sees_the_same_global_batches(world_size):
    """A global batch is the same examples on any number of workers; an epoch visits each
    example at most once and drops only the last partial batch."""
    num_rows, batch_size, seed = 70, 8, 3
    steps_per_epoch, _ = count_steps(FinetuneConfig(**REQUIRED, batch_size=batch_size), num_rows)
    assert steps_per_epoch == 8
    for step in range(2 * steps_per_epoch):
        alone = batch_indices(num_rows, batch_size, step, steps_per_epoch, seed, 0, 1)
        shared = [batch_indices(num_rows, batch_size, step, steps_per_epoch, seed, rank,
                                world_size) for rank in range(world_size)]
        assert sorted(np.concatenate(shared).tolist()) == sorted(alone.tolist())
    epoch = np.concatenate([batch_indices(num_rows, batch_size, s, steps_per_epoch, seed, 0, 1)
                            for s in range(steps_per_epoch)])
    assert len(set(epoch.tolist())) == 64
    again = batch_indices(num_rows, batch_size, steps_per_epoch, steps_per_epoch, seed, 0, 1)
    assert again.tolist() != batch_indices(num_rows, batch_size, 0, steps_per_epoch, seed, 0,
                                           1).tolist()  # a new order each epoch


def test_too_few_examples_for_one_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one batch of 32"):
        count_steps(FinetuneConfig(**REQUIRED), 20)


def test_subsets_are_fixed_and_keep_the_file_order():
    items = list(range(100))
    subset = subsample(items, 10)
    assert subset == sorted(subset) and len(subset) == 10 and subsample(items, 10) == subset
    assert subsample(items, None) == items and subsample(items, 500) == items


def test_sweep_statistics_and_summary_line():
    stats = sweep_statistics([0.80, 0.90, 0.85, 0.70])
    assert stats["best"] == 0.90 and stats["median"] == pytest.approx(0.825)
    assert (stats["min"], stats["max"]) == (0.70, 0.90)
    assert stats["std"] == pytest.approx(np.std([0.80, 0.90, 0.85, 0.70]))
    results = {
        "task": "mrpc", "primary_metric": "f1", "score": 0.9, "metrics": {"f1": 0.9,
                                                                          "accuracy": 0.85},
        "best_run": {"learning_rate": 3e-5, "seed": 2}, "sweep": {"num_runs": 4, **stats},
        "model": {"source": "/m", "kind": "run_dir", "random_init": False},
        "seconds": 12.0, "output": os.path.join("/x", "out"),
    }
    line = summary_line(results)
    assert line.startswith("[finetune] mrpc: f1 0.9000 (lr 3e-05, seed 2); 4 runs: median 0.8250")
    assert "accuracy 0.8500" in line and "from /m (run_dir)" in line
    # MRPC's dev set is 68 % paraphrases: the line says what answering that always scores,
    # and a best run that answered one label only.
    chance = {"label": "equivalent", "metrics": {"f1": 0.8095, "accuracy": 0.68}}
    line = summary_line({**results, "chance": chance, "single_label": "equivalent"})
    assert ("accuracy 0.8500; always 'equivalent': f1 0.8095, accuracy 0.6800 (it predicted "
            "'equivalent' for every dev example)") in line


def test_a_run_s_line_gives_the_commonest_label_s_score_and_says_it_learned_nothing(
        tmp_path, capsys):
    from bertforge.cluster.commands.finetune_sweep import _finished

    result = {"metrics": {"accuracy": 0.5092}, "single_label": "positive",
              "chance": {"label": "positive", "metrics": {"accuracy": 0.5092}}}
    (tmp_path / "result.json").write_text(json.dumps(result))
    _finished(str(tmp_path), "lr0.0003-seed1", result, 6.4)
    assert capsys.readouterr().out.splitlines() == [
        "[finetune] lr0.0003-seed1: finished in 6.4 s (accuracy 0.5092; always 'positive': "
        "accuracy 0.5092)",
        "[finetune] lr0.0003-seed1: predicted 'positive' for every dev example: it learned "
        "nothing (the BERT paper restarts such runs: other --seeds, another --lr, or --sweep)",
    ]
    assert json.loads((tmp_path / "result.json").read_text())["run_seconds"] == 6.4


def test_a_hugging_face_dir_without_weights_is_refused_on_the_driver(tmp_path):
    """The driver's check reads no weights, the workers do: it must refuse a directory that
    has config.json and vocab.txt but no weights file, in one line, before Ray."""
    from bertforge.cluster.commands.finetune_sweep import check_inputs
    from bertforge.training.finetune.load import load_pretrained
    from bertforge.training.hf_interop import HF_WEIGHTS_NAMES
    from tests.support.finetune_data import tiny_bert_dir, write_sst2_tsv

    model = tiny_bert_dir(str(tmp_path / "m"))
    removed = [name for name in HF_WEIGHTS_NAMES if os.path.exists(os.path.join(model, name))]
    assert removed, os.listdir(model)  # the fixture wrote weights: this test removes them
    for name in removed:
        os.remove(os.path.join(model, name))
    train = write_sst2_tsv(str(tmp_path / "train.tsv"), 32, seed=1)
    dev = write_sst2_tsv(str(tmp_path / "dev.tsv"), 16, seed=2)
    cfg = FinetuneConfig(task="sst2", model=model, output=str(tmp_path / "out"), train=train,
                         dev=dev, batch_size=16)
    with pytest.raises(ValueError, match=f"model {model} is neither") as error:
        check_inputs(cfg, LaunchConfig(workers=1))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="is neither"):  # the workers' rule is the same
        load_pretrained(model)
    # Random init reads no weights: the same directory passes.
    facts = check_inputs(dataclasses.replace(cfg, random_init=True), LaunchConfig(workers=1))
    assert facts["num_train_examples"] == 32


def test_one_file_as_train_and_dev_is_a_squad_split_or_refused(tmp_path):
    """A link to SQuAD's dev file as --train trained on the dev set, then scored it: the names
    differed, so it was no split. For a GLUE task, one file as both was taken silently."""
    squad = tmp_path / "dev-v1.1.json"
    squad.write_text("{}")
    (tmp_path / "link.json").symlink_to(squad)
    linked = resolve_data_files(FinetuneConfig(**{**REQUIRED, "task": "squad"},
                                               train=str(tmp_path / "link.json"), dev=str(squad)))
    assert "split by article" in data_note(linked)
    tsv = tmp_path / "dev.tsv"
    tsv.write_text("sentence\tlabel\n")
    with pytest.raises(ValueError, match="--train and --dev are one file"):
        resolve_data_files(FinetuneConfig(**REQUIRED, train=str(tsv),
                                          dev=str(tmp_path / "." / "dev.tsv")))
    # A copy is the same examples (shared/data's glue-sst2-dev.tsv is GLUE's SST-2 dev.tsv):
    # it trained on the dev set and scored it. SQuAD's copy is split by article.
    copy = tmp_path / "copy.tsv"
    copy.write_text("sentence\tlabel\n")
    with pytest.raises(ValueError, match="--train and --dev are one file .*, or copies of it"):
        resolve_data_files(FinetuneConfig(**REQUIRED, train=str(copy), dev=str(tsv)))
    (tmp_path / "squad-copy.json").write_text("{}")
    copied = resolve_data_files(FinetuneConfig(**{**REQUIRED, "task": "squad"},
                                               train=str(tmp_path / "squad-copy.json"),
                                               dev=str(squad)))
    assert "split by article" in data_note(copied)
    other = tmp_path / "train.tsv"
    other.write_text("sentence\tlabel\n" + "a\t1\n")  # another file of its own: taken
    assert resolve_data_files(FinetuneConfig(**REQUIRED, train=str(other), dev=str(tsv))).train
    # --dev alone is refused, as the help says ("both, or neither").
    with pytest.raises(ValueError, match="give both --train and --dev"):
        resolve_data_files(FinetuneConfig(**REQUIRED, dev=str(tsv), data_root=str(tmp_path)))


def test_of_equal_scores_the_best_run_is_one_whose_model_is_kept(tmp_path):
    """A sweep keeps only its best run's export. Rerun with its rates in another order, the
    first of two equal scores was a run whose export was gone: DIR/hf was lost."""
    from bertforge.cluster.commands.finetune_sweep import best_run

    kept = tmp_path / "lr1e-05" / "hf"
    kept.mkdir(parents=True)
    records = [{"learning_rate": 2e-5, "metrics": {"accuracy": 0.5},
                "hf_dir": str(tmp_path / "lr2e-05" / "hf")},
               {"learning_rate": 1e-5, "metrics": {"accuracy": 0.5}, "hf_dir": str(kept)},
               {"learning_rate": 3e-5, "metrics": {"accuracy": 0.25}, "hf_dir": None}]
    assert best_run(records, "accuracy")["learning_rate"] == 1e-5
    kept.rmdir()  # neither kept: the first in the runs' order
    assert best_run(records, "accuracy")["learning_rate"] == 2e-5


def test_a_label_column_of_sentences_is_named_not_listed_whole(tmp_path):
    from bertforge.training.finetune.glue_data import read_examples
    from bertforge.training.finetune.tasks import TaskSpec

    spec = TaskSpec(name="custom", text_columns=(0,), label_column=1,
                    labels=tuple(f"sentence number {i} " * 20 for i in range(200)),
                    metrics=("accuracy",), primary_metric="accuracy", has_header=False,
                    train_file=None, dev_file=None)
    path = tmp_path / "train.tsv"
    path.write_text("a\tsomething else entirely\n")
    with pytest.raises(ValueError) as refused:
        read_examples(str(path), spec)
    message = str(refused.value)
    assert len(message) < 1500 and "200 labels, the first" in message
    assert "is --label-column a text column?" in message


def test_a_header_read_as_data_is_not_made_a_class(tmp_path):
    """`--no-has-header` on a file that has a header: its `label` became a third class of a
    binary task, scored without a word."""
    from bertforge.training.finetune.glue_data import read_label_set
    from bertforge.training.finetune.tasks import custom_task

    path = tmp_path / "train.tsv"
    path.write_text("sentence\tlabel\na fine film\t1\na dull one\t0\nanother\t1\n")
    without_header = custom_task((0,), 1, labels=("0", "1"), has_header=False)
    with pytest.raises(ValueError, match=r"line 1: label 'label' is the one label that is no "
                                         r"number, and only this line has it: a header line\?"):
        read_label_set(str(path), without_header)
    with_header = custom_task(("sentence",), "label", labels=("0", "1"), has_header=True)
    assert read_label_set(str(path), with_header) == ("0", "1")
    # Word labels are the task's own: no header in sight.
    path.write_text("a fine film\tpositive\na dull one\tnegative\nanother\tneutral\n")
    assert read_label_set(str(path), without_header) == ("negative", "neutral", "positive")


def test_a_length_past_the_models_positions_names_the_flags_that_fit(tmp_path):
    """SQuAD's default 384 tokens on a model of 128 positions was refused with no word of
    what to give instead; the flags must fit SQuAD's windows too (stride < window)."""
    from bertforge.cluster.commands.finetune_sweep import check_inputs
    from tests.support.finetune_data import tiny_bert_dir, write_squad_json

    model = tiny_bert_dir(str(tmp_path / "m"), max_position_embeddings=128)
    squad = write_squad_json(str(tmp_path / "squad.json"))
    cfg = FinetuneConfig(task="squad", model=model, output=str(tmp_path / "out"), train=squad,
                         dev=squad)
    with pytest.raises(ValueError) as error:
        check_inputs(cfg, LaunchConfig(workers=1))
    assert str(error.value) == (
        f"max_seq_length 384 exceeds the model's max_position_embeddings 128 ({model}); give "
        "--max-seq-length 128 --doc-stride 30")
    # What it says to give is accepted.
    facts = check_inputs(dataclasses.replace(cfg, max_seq_length=128, doc_stride=30),
                         LaunchConfig(workers=1))
    assert facts["num_dev_examples"] > 0
    # Positions too few for a 64-token question: a shorter question is named too.
    model = tiny_bert_dir(str(tmp_path / "m64"), max_position_embeddings=64)
    with pytest.raises(ValueError, match="give --max-seq-length 64 --max-query-length 30 "
                                         "--doc-stride 15$"):
        check_inputs(dataclasses.replace(cfg, model=model), LaunchConfig(workers=1))
    check_inputs(dataclasses.replace(cfg, model=model, max_seq_length=64, max_query_length=30,
                                     doc_stride=15), LaunchConfig(workers=1))
