"""`bertforge pipeline`: configuration checks, and the whole chain on a tiny corpus through the
real engines (Beam, Ray Train + DeepSpeed), run again to show it skips, resumes and refuses."""

import json
import os
import re
import shutil

import pytest

from bertforge.cluster.cli import main
from bertforge.cluster.commands import stages
from bertforge.cluster.commands.pipeline import (
    HOW_TO_RUN_KEYS,
    PipelineConfig,
    PipelinePaths,
    check_phases_can_start,
    load_config,
    run_pipeline,
)
from bertforge.cluster.commands.stage_runner import (
    Stage,
    StageRunner,
    differing_keys,
    exclusive_directory,
)

MINIMAL = {
    "workdir": "work",
    "prepare": {"inputs": ["corpus/*.jsonl"]},
    "phase1": {"recipe": "bert_tiny_phase1", "max_seq_length": 64},
}


def config_of(tmp_path, **changes) -> PipelineConfig:
    data = json.loads(json.dumps(MINIMAL))
    for dotted, value in changes.items():
        *tables, key = dotted.split("__")
        target = data
        for table in tables:
            target = target.setdefault(table, {})
        target[key] = value
    return PipelineConfig.from_dict(data, str(tmp_path))


# --- configuration --------------------------------------------------------------------------


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "p.toml"
    path.write_text('workdir = "../work"\n[prepare]\ninputs = ["books:corpus/*.txt", "a.jsonl"]\n'
                    '[phase1]\nrecipe = "bert_tiny_phase1"\nmax_seq_length = 64\n'
                    '[cluster]\nstorage = "store"\n')
    config, text = load_config(str(path))
    assert config.workdir == str(tmp_path / "work")
    # [cluster]'s storage too (it was the working directory's: checkpoints went to /store).
    assert config.cluster.storage == str(tmp_path / "conf" / "store")
    assert config.prepare.options.inputs == (f"books:{tmp_path}/conf/corpus/*.txt",
                                     f"{tmp_path}/conf/a.jsonl")
    assert text.startswith("workdir")
    recipes = config.train_configs()
    assert recipes["phase1"].data_dir == str(tmp_path / "work" / "shards-64")
    assert recipes["phase1"].run_dir == str(tmp_path / "work" / "runs" / "phase1")


def test_phase2_warm_starts_from_phase1s_run(tmp_path):
    config = config_of(tmp_path, phase2={"recipe": "bert_tiny_phase2", "max_seq_length": 128,
                                         "overrides": {"max_steps": 4}})
    phase2 = config.train_configs()["phase2"]
    assert phase2.init_from == str(tmp_path / "work" / "runs" / "phase1")
    assert phase2.max_steps == 4 and phase2.data_dir.endswith("shards-128") and phase2.resume


@pytest.mark.parametrize("changes, message", [
    ({"colour": "red"}, "unknown top-level key(s): colour"),
    ({"cluster__nodes": 3}, "unknown key(s) in [cluster]: nodes"),
    ({"cluster__workers": "2"}, "cluster.workers must be int"),
    ({"cluster__workers": True}, "cluster.workers must be int"),
    ({"cluster__workers": 0}, "cluster: workers must be at least 1"),
    ({"phase1__recipe": "bert_huge"}, "phase1: unknown recipe 'bert_huge'"),
    ({"phase1__overrides": {"max_stepz": 3}}, "phase1: overrides: unknown or pipeline-owned "
                                              "key(s) max_stepz"),
    ({"phase1__overrides": {"data_dir": "x"}}, "pipeline-owned key(s) data_dir"),
    ({"phase1__overrides": {"max_steps": 0}}, "phase1: max_steps must be at least 1"),
    ({"phase1__overrides": {"model": "mini"}},
     'overrides.model must be a table of BertConfig fields, e.g. model = { preset = "mini" }'),
    ({"phase1__overrides": {"max_steps": "40"}}, "overrides.max_steps must be int, got '40'"),
    # Found by the phase's train before, after the vocabulary and both prepares had run, and
    # recorded: the corrected file was then refused as "other settings".
    ({"phase1__overrides": {"model": {"preset": "huge"}}},
     "phase1: unknown model preset 'huge'; choose one of"),
    ({"phase1__max_seq_length": 1024}, "phase1: the phase's dataset holds sequences of up to "
                                       "1024 tokens, but the model has max_position_embeddings"),
    ({"phase1__max_seq_length": "128"}, "phase1.max_seq_length must be int"),
    ({"phase2": {"recipe": "bert_tiny_phase2"}}, "phase2.max_seq_length is required"),
    ({"phase2": {"recipe": "bert_tiny_phase2", "max_seq_length": 128,
                 "overrides": {"init_from": "x"}}}, "pipeline-owned key(s) init_from"),
    # Phase 2's train refused it, once phase 1 had trained (and pinned the workdir).
    ({"phase2": {"recipe": "bert_tiny_phase2", "max_seq_length": 128,
                 "overrides": {"model": {"preset": "mini"}}}},
     "phase2 warm-starts from phase1's weights, but its model is another (phase1 != phase2: "
     "hidden_size 128 != 256"),
    # Phase 2's recipe at phase 1's length trained phase 1 again under phase 2's name.
    ({"phase2": {"recipe": "bert_tiny_phase2", "max_seq_length": 64}},
     "phase2: recipe bert_tiny_phase2 trains at longer sequences than phase 1, and "
     "max_seq_length 64 is not longer than phase1's 64: give [phase2] max_seq_length = 512"),
    ({"prepare__num_shards": 0}, "prepare: num_shards must be at least 1"),
    ({"prepare__inputs": []}, "prepare.inputs is required"),
    ({"prepare__beam_args": ["--output=/elsewhere"]},
     "must not set the job's own options (--output=/elsewhere)"),
    ({"prepare__beam_args": ["--direct_num_worker=2"]}, "prepare.beam_args: unknown flag"),
    ({"vocab__path": "v.txt", "vocab__vocab_size": 100}, "vocab.path uses an existing vocab"),
    ({"vocab__vocab_size": 3}, "vocab: vocab_size must exceed the 5 special tokens"),
    ({"vocab__size": 100}, "vocab.size is spelled vocab_size, as the flag is"),
    ({"vocab__lowercase": True}, "unknown key(s) in [vocab]: lowercase"),
    ({"workdir": "gs://bucket/work"}, "workdir must be a local or mounted path"),
    # One validation of the length, the job's own, for every phase.
    ({"phase1__max_seq_length": 4}, "max_seq_length must be at least 5 ([CLS] A [SEP] B [SEP]), "
                                    "got 4"),
    ({"phase2": {"recipe": "bert_tiny_phase2", "max_seq_length": 3}},
     "max_seq_length must be at least 5 ([CLS] A [SEP] B [SEP]), got 3"),
    # Flags of `bertforge prepare` that a pipeline file gives elsewhere: said where.
    ({"prepare__max_seq_length": 64},
     "[prepare] cannot set max_seq_length: give it in each [phaseN]"),
    ({"prepare__lower_case": False, "prepare__output": "x"},
     "[prepare] cannot set lower_case: give it in [vocab]; output: the pipeline writes the "
     "shards under workdir"),
    ({"prepare__dupe_factr": 2}, "unknown key(s) in [prepare]: dupe_factr; known: beam_args, "
                                 "dupe_factor, inputs, num_shards,"),
    ({"prepare__random_pool_chars": 0}, "prepare: random_pool_chars must be at least 1"),
    ({"cluster__placement_strategy": "ANY"}, "cluster: unknown placement strategy 'ANY'"),
])
def test_configuration_errors_name_the_key(tmp_path, changes, message):
    with pytest.raises(ValueError) as error:
        config_of(tmp_path, **changes)
    assert message in str(error.value)


def test_what_a_phase_would_refuse_at_its_start_is_refused_before_any_stage(tmp_path):
    """FP8 where auto is fp32 here (the suite's CPU setting), fp16 on a CPU, a global batch the
    micro-batches do not divide: refused by the phase's train after the vocabulary and the
    prepares had run, whose recorded settings then refused the corrected file. A pipeline for
    a cluster's GPUs is not this CPU's to judge (its engine)."""
    config = config_of(tmp_path, phase1__overrides={"fp8": True})
    with pytest.raises(ValueError, match="^phase1: .*fp8"):
        run_pipeline(config)
    assert not os.path.exists(tmp_path / "work")
    on_gpus = config_of(tmp_path, phase1__overrides={"fp8": True}, cluster__gpu=True)
    check_phases_can_start(on_gpus)
    # A global batch the workers' micro-batches do not divide: a cluster's run too.
    uneven = config_of(tmp_path, phase1__overrides={"micro_batch_size": 8,
                                                    "global_batch_size": 12}, cluster__gpu=True)
    with pytest.raises(ValueError, match="^phase1: global_batch_size 12 is not a multiple of "
                       "micro_batch_size x world_size = 8 x 2 = 16"):
        run_pipeline(uneven)
    assert not os.path.exists(tmp_path / "work")


def test_a_pipeline_file_that_is_not_there_is_named(tmp_path):
    for path, said in ((tmp_path / "nope.toml", "no such file"),
                       (tmp_path, "a directory, not a TOML file")):
        with pytest.raises(ValueError, match=f"^pipeline file {path}: {said}$"):
            load_config(str(path))


def test_the_readme_example_is_a_valid_configuration(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The whole chain from one file", 1)[1]
    example = re.search(r"^```toml\n(.*?)^```", section, re.M | re.S).group(1)
    (tmp_path / "example.toml").write_text(example)
    config, _ = load_config(str(tmp_path / "example.toml"))
    assert config.cluster.gpu and config.phase2.max_seq_length == 512
    assert config.train_configs()["phase1"].max_steps == 56250


def test_missing_sections_and_bad_toml_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="phase1 is required"):
        PipelineConfig.from_dict({"workdir": "w", "prepare": {"inputs": ["a"]}}, str(tmp_path))
    path = tmp_path / "bad.toml"
    path.write_text("workdir = \n")
    assert main(["pipeline", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is not valid TOML" in err and "Traceback" not in err


def test_a_changed_configuration_is_refused_naming_the_keys(tmp_path):
    config = config_of(tmp_path, phase1__overrides={"max_steps": 8})
    paths = PipelinePaths(config.workdir)

    def enter(config: PipelineConfig) -> None:
        with StageRunner(paths.root, "pipeline", config.settings(),
                         ignored=HOW_TO_RUN_KEYS) as runner:
            runner.run([Stage("vocab", lambda: {})])  # the directory holds finished work

    enter(config)
    # How to run may change (prepare locally, train on a cluster); what to make may not.
    enter(config_of(tmp_path, phase1__overrides={"max_steps": 8}, cluster__workers=4,
                    prepare__rows_per_piece=64))
    changed = config_of(tmp_path, phase1__overrides={"max_steps": 9}, prepare__dupe_factor=2)
    with pytest.raises(ValueError) as error:
        enter(changed)
    message = str(error.value)
    assert "made with other settings" in message
    assert "config.phase1.overrides.max_steps" in message
    assert "recipes.phase1.max_steps" in message
    assert "config.prepare.options.dupe_factor" in message


def test_the_refusal_names_the_keys_as_the_file_spells_them(tmp_path):
    """`num_shards` and `dupe_factor` changed in [prepare]: the line named
    `config.prepare.options.num_shards`, and a phase's key came with the resolved recipe
    values it changed (`recipes.phase2.data_dir` beside `config.phase2.max_seq_length`), none
    of which a pipeline file has."""
    config = config_of(tmp_path)
    with StageRunner(PipelinePaths(config.workdir).root, "pipeline", config.settings(),
                     ignored=HOW_TO_RUN_KEYS) as runner:
        runner.run([Stage("vocab", lambda: {})])  # the workdir holds finished work
    with pytest.raises(ValueError) as error:
        run_pipeline(config_of(tmp_path, prepare__num_shards=3, prepare__dupe_factor=2))
    assert "(differs in: [prepare] dupe_factor, [prepare] num_shards);" in str(error.value)
    from bertforge.cluster.commands.pipeline import as_the_file_names_them

    assert as_the_file_names_them([
        "config.phase1.overrides.learning_rate", "config.phase2.max_seq_length",
        "config.prepare.options.output", "recipes.phase1.learning_rate",
        "recipes.phase2.data_dir", "config.vocab.path", "config.workdir", "config.phase2"]) == [
        "[phase1] overrides.learning_rate", "[phase2] max_seq_length", "[vocab] path",
        "workdir", "[phase2]"]
    # The pipeline's own values are named where no key of the file explains them.
    assert as_the_file_names_them(["recipes.phase1.learning_rate"]) == [
        "phase1's resolved learning_rate"]


def test_a_project_folder_moved_whole_is_the_same_pipeline(tmp_path):
    """pipeline.toml, its corpus and its workdir moved (or copied) together: the paths the
    state recorded are compared relative to the file's folder, so the rerun skips what is
    done instead of refusing "other settings"; a real change is still refused."""
    import shutil

    def enter(project, base_dir, **changes):
        config = config_of(project, **changes)
        with StageRunner(PipelinePaths(config.workdir).root, "pipeline", config.settings(),
                         ignored=HOW_TO_RUN_KEYS, base_dir=base_dir) as runner:
            return runner.run([Stage("vocab", lambda: {})])

    old, new = tmp_path / "old", tmp_path / "new"
    assert enter(old, str(old)) == {"ran": ["vocab"], "skipped": []}
    shutil.move(str(old), str(new))
    assert enter(new, str(new)) == {"ran": [], "skipped": ["vocab"]}
    state = json.loads((new / "work" / "pipeline.json").read_text())
    assert state["base_dir"] == str(new)
    assert state["settings"]["config"]["workdir"] == str(new / "work")  # today's paths
    with pytest.raises(ValueError, match="config.prepare.options.dupe_factor"):
        enter(new, str(new), prepare__dupe_factor=2)
    # Compared as absolute paths (no base: a caller of the Python API), it is another job.
    shutil.move(str(new), str(old))
    with pytest.raises(ValueError, match="config.workdir"):
        enter(old, None)
    # A state recorded without a base (before there was one): read against today's base, so
    # an unmoved folder is still the same pipeline.
    legacy = tmp_path / "legacy"
    enter(legacy, None)
    state_file = legacy / "work" / "pipeline.json"
    state = json.loads(state_file.read_text())
    del state["base_dir"]
    state_file.write_text(json.dumps(state))
    assert enter(legacy, str(legacy)) == {"ran": [], "skipped": ["vocab"]}
    # That rerun in place records where its stages ran, so a move after it is one.
    assert json.loads(state_file.read_text())["stages"]["vocab"]["base_dir"] == str(legacy)
    shutil.move(str(legacy), str(new))
    config = config_of(new)
    with StageRunner(PipelinePaths(config.workdir).root, "pipeline", config.settings(),
                     ignored=HOW_TO_RUN_KEYS, base_dir=str(new)) as runner:
        assert runner.moved_since("vocab") == (str(legacy), str(new))


def test_a_workdir_moved_on_its_own_is_told_where_it_belongs(tmp_path):
    """A workdir moved alone (not with its pipeline file's folder) and named anew in the file
    was refused with "delete it to start over", its vocabulary, shards and checkpoints with
    it; where it was made, it is the same pipeline."""
    made = config_of(tmp_path, workdir="work")
    with StageRunner(PipelinePaths(made.workdir).root, "pipeline", made.settings(),
                     ignored=HOW_TO_RUN_KEYS) as runner:
        runner.run([Stage("vocab", lambda: {})])
    shutil.move(str(tmp_path / "work"), str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError) as error:
        run_pipeline(config_of(tmp_path, workdir="elsewhere"))
    assert str(error.value).endswith(
        f"(differs in: workdir); it was made as {tmp_path}/work: move it back there (a workdir "
        "moves only with the folder of its pipeline file, at the same place in it), or delete "
        "it to start over")
    # Moved and changed: the change is what the line is about.
    with pytest.raises(ValueError, match=r"\[prepare\] seed, workdir\); use another workdir"):
        run_pipeline(config_of(tmp_path, workdir="elsewhere", prepare__seed=7))


def test_a_workdir_outside_the_file_s_folder_is_compared_by_absolute_paths(tmp_path):
    """Two projects' files naming one absolute workdir (and each its own corpus/): the second
    is another pipeline, refused, although its paths relative to its own folder are the
    first's."""
    workdir = str(tmp_path / "scratch" / "run")

    def enter(project):
        config = config_of(project, workdir=workdir)
        with StageRunner(PipelinePaths(config.workdir).root, "pipeline", config.settings(),
                         ignored=HOW_TO_RUN_KEYS, base_dir=str(project)) as runner:
            runner.run([Stage("vocab", lambda: {})])

    enter(tmp_path / "a")
    enter(tmp_path / "a")  # the same project again
    with pytest.raises(ValueError, match="config.prepare.options.inputs"):
        enter(tmp_path / "b")


def test_relative_paths_keep_format_prefixes_and_leave_other_places_alone():
    from bertforge.cluster.commands.stage_runner import relative_paths

    settings = {"a": "/p/work", "b": ["books:/p/corpus/*.txt", "/q/x", "gs://b/p"],
                "c": {"d": "/p", "e": 3, "f": "/pp/x"}}
    assert relative_paths(settings, "/p") == {
        "a": "<base>/work", "b": ["books:<base>/corpus/*.txt", "/q/x", "gs://b/p"],
        "c": {"d": "<base>", "e": 3, "f": "/pp/x"}}
    assert relative_paths(settings, "/")["b"] == ["books:<base>/p/corpus/*.txt", "<base>/q/x",
                                                  "gs://b/p"]  # a URL is no path under /


def test_inputs_of_a_moved_folder_are_looked_for_where_it_is_now(tmp_path):
    """dataset_identity's mapping of a recorded input location into the moved folder: a link
    inside the folder (a corpus kept elsewhere) is followed where the folder is now, where it
    could not be followed where the folder was."""
    from bertforge.pipelines.dataset_identity import moved_location

    (tmp_path / "big").mkdir()
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "corpus").symlink_to(tmp_path / "big")
    old = str(tmp_path / "old")  # gone: moved to new
    assert moved_location(f"{old}/corpus/a.txt", (old, str(tmp_path / "new"))) == \
        str(tmp_path / "big" / "a.txt")
    assert moved_location(f"{old}x/a.txt", (old, str(tmp_path / "new"))) == f"{old}x/a.txt"
    assert moved_location("/x/a.txt", ("/", "/z")) == "/z/x/a.txt"
    assert moved_location("/x/a.txt", None) == "/x/a.txt"


def test_differing_keys_ignore_how_to_run():
    old = {"config": {"cluster": {"workers": 2},
                      "prepare": {"beam_args": ["a"], "options": {"seed": 1}}}}
    new = {"config": {"cluster": {"workers": 8},
                      "prepare": {"beam_args": [], "options": {"seed": 2}}}}
    assert differing_keys(old, new, HOW_TO_RUN_KEYS) == ["config.prepare.options.seed"]
    assert differing_keys(old, new) == ["config.cluster.workers", "config.prepare.beam_args",
                                        "config.prepare.options.seed"]


def test_a_workdir_under_an_input_folder_is_not_read_as_corpus(tmp_path, caplog):
    """`inputs = ["."]` beside the workdir: its pipeline.json, lock, runs and export were read
    as corpus, and every later run was refused, those being "new input files"."""
    import logging

    from bertforge.pipelines.read.inputs_transform import match_inputs

    config = config_of(tmp_path, prepare__inputs=["."])
    with StageRunner(config.workdir, "pipeline", config.settings()) as runner:
        runner.run([Stage("vocab", lambda: {})])
    (tmp_path / "work" / "hf").mkdir()
    (tmp_path / "work" / "hf" / "config.json").write_text("{}")
    (tmp_path / "corpus.txt").write_text("One. Two.\n")
    # The pipeline file beside it: each edit of it was an input "of another size".
    (tmp_path / "pipe.toml").write_text('workdir = "work"\n[phase1]\nrecipe = "x"\n')
    (tmp_path / "notes.toml").write_text('title = "mine"\n')  # any other TOML is read
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pipeline.json").write_text('{"a": 1}')  # a corpus file of that name
    with caplog.at_level(logging.INFO):
        assert match_inputs(config.prepare.options.inputs) == [
            (str(tmp_path / "corpus.txt"), None), (str(tmp_path / "data" / "pipeline.json"), None),
            (str(tmp_path / "notes.toml"), None)]
    assert [r.getMessage() for r in caplog.records if "leaving out" in r.getMessage()] == [
        f"leaving out {tmp_path / 'pipe.toml'}: a bertforge pipeline file, not corpus",
        f"leaving out {tmp_path / 'work'}: a bertforge pipeline's workdir (its own files), "
        "not corpus"]
    # The workdir itself as the input: nothing is left, and the error says why.
    with pytest.raises(ValueError, match=r"matches no file outside a bertforge pipeline's "
                       r"workdir \(what it writes is never read as corpus\)"):
        match_inputs((config.workdir,))


def _vocab_stage(config, runner):
    from bertforge.cluster.commands.pipeline import build_stages

    (stage,) = [s for s in build_stages(config, PipelinePaths(config.workdir), runner)
                if s.name == "vocab"]
    return stage


def _a_dataset_made(config):
    """shards as the vocab stage judges them made: their manifest is there."""
    shards = PipelinePaths(config.workdir).shards(64)
    os.makedirs(shards)
    (open(os.path.join(shards, "manifest.json"), "w")).close()


def test_an_edited_vocab_path_is_taken_or_refused(tmp_path, capsys):
    """An edited `[vocab] path` file was ignored while the workdir held its copy."""
    source = tmp_path / "google-vocab.txt"
    source.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    config = config_of(tmp_path, vocab={"path": "google-vocab.txt"})
    copy = PipelinePaths(config.workdir).vocab
    with StageRunner(config.workdir, "pipeline", config.settings()) as runner:
        assert runner.run([_vocab_stage(config, runner)])["ran"] == ["vocab"]
        assert runner.run([_vocab_stage(config, runner)])["skipped"] == ["vocab"]
        source.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nand\n")
        # Nothing made with the copy yet: the edited file is taken, and said.
        assert runner.run([_vocab_stage(config, runner)])["ran"] == ["vocab"]
        assert (f"vocab: vocab.path {source} changed since it was copied to {copy}, and nothing "
                "was made with it yet: making it again") in capsys.readouterr().out
        assert open(copy).read().endswith("and\n")
        _a_dataset_made(config)
        source.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
        with pytest.raises(ValueError, match=re.escape(
                f"vocab.path {source} changed since it was copied to {copy}, and "
                f"{config.workdir}'s shards-64 was made with it; restore it, or delete it to "
                "make it again from the new vocabulary")):
            runner.run([_vocab_stage(config, runner)])
        source.unlink()  # gone since it was copied: the copy is all there is, and is kept
        assert runner.run([_vocab_stage(config, runner)])["skipped"] == ["vocab"]


def test_a_vocab_trained_on_inputs_changed_since_is_trained_again_or_refused(tmp_path,
                                                                             capsys):
    """A book replaced in the inputs (and the shards deleted): the old vocabulary was kept
    without a word. The stage records what it trained on, as prepare's manifest does."""
    from bertforge.cluster.demo.docstring_corpus import write_docstring_corpus

    corpus = tmp_path / "corpus" / "docs.jsonl"
    write_docstring_corpus(str(corpus), target_bytes=60_000)
    config = config_of(tmp_path, vocab={"vocab_size": 300})
    vocab = PipelinePaths(config.workdir).vocab
    with StageRunner(config.workdir, "pipeline", config.settings()) as runner:
        assert runner.run([_vocab_stage(config, runner)])["ran"] == ["vocab"]
        assert runner.run([_vocab_stage(config, runner)])["skipped"] == ["vocab"]
        (tmp_path / "corpus" / "book.jsonl").write_text('{"text": "A new book. Its words."}\n')
        assert runner.run([_vocab_stage(config, runner)])["ran"] == ["vocab"]
        assert (f"vocab: the input files {vocab} was trained on changed since (new: "
                f"{tmp_path}/corpus/book.jsonl), and nothing was made with it yet: making it "
                "again") in capsys.readouterr().out
        _a_dataset_made(config)
        (tmp_path / "corpus" / "book.jsonl").write_text('{"text": "Another book. Longer."}\n')
        with pytest.raises(ValueError, match=re.escape(
                f"the input files {vocab} was trained on changed since (another size: "
                f"{tmp_path}/corpus/book.jsonl), and {config.workdir}'s shards-64 was made with "
                "it; restore those inputs, or delete it to make it again from the new "
                "vocabulary")):
            runner.run([_vocab_stage(config, runner)])
        (tmp_path / "corpus" / "book.jsonl").unlink()  # deleted since: no change
        assert runner.run([_vocab_stage(config, runner)])["skipped"] == ["vocab"]


def test_a_foreign_workdir_and_a_concurrent_run_are_refused(tmp_path):
    config = config_of(tmp_path)
    os.makedirs(config.workdir)
    (tmp_path / "work" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no bertforge pipeline"):
        run_pipeline(config)
    with exclusive_directory(str(tmp_path / "locked"), "pipeline"):
        with pytest.raises(ValueError, match="another bertforge pipeline is running"):
            with exclusive_directory(str(tmp_path / "locked"), "pipeline"):
                pass


# --- end to end -----------------------------------------------------------------------------

TINY_TOML = """
workdir = "work"

[vocab]
vocab_size = 2000

[prepare]
inputs = ["corpus/*.jsonl"]
beam_args = ["--runner=DirectRunner"]
num_shards = 2
dupe_factor = 1

[phase1]
recipe = "bert_tiny_phase1"
max_seq_length = 64
overrides = { max_steps = 8, warmup_steps = 1, log_every = 4 }

[phase2]
recipe = "bert_tiny_phase2"
max_seq_length = 128
overrides = { max_steps = 4, warmup_steps = 1, log_every = 2, checkpoint_every = 2 }

[cluster]
workers = 2
max_failures = 0
"""


@pytest.fixture(scope="module")
def finished_pipeline(tmp_path_factory):
    import ray

    from bertforge.cluster.demo.docstring_corpus import write_docstring_corpus

    root = tmp_path_factory.mktemp("pipeline")
    write_docstring_corpus(str(root / "corpus" / "docs.jsonl"), target_bytes=300_000)
    # Phase 1 alone first, then the file with [phase2] added, as a user grows a pipeline.
    phase2 = TINY_TOML[TINY_TOML.index("[phase2]"):TINY_TOML.index("[cluster]")]
    (root / "pipeline.toml").write_text(TINY_TOML.replace(phase2, ""))
    # The file's folder as the base, as `bertforge pipeline FILE` gives it.
    phase1_only = run_pipeline(*load_config(str(root / "pipeline.toml")), str(root))
    (root / "pipeline.toml").write_text(TINY_TOML)
    config, text = load_config(str(root / "pipeline.toml"))
    first = {**run_pipeline(config, text, str(root)), "phase1_only": phase1_only}
    yield root, config, first
    ray.shutdown()


def _forbid_work(monkeypatch):
    """Any stage that does work fails the test: a rerun must only look at outputs."""
    def fail(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr("bertforge.pipelines.vocab.train_wordpiece_vocab", fail)
    monkeypatch.setattr("bertforge.pipelines.prepare.run", fail)
    monkeypatch.setattr("bertforge.cluster.launch.ray_train.train_on_ray", fail)
    monkeypatch.setattr("bertforge.training.export.export_checkpoint", fail)


@pytest.mark.slow
def test_first_run_does_every_stage_and_records_the_configuration(finished_pipeline):
    from bertforge.training.checkpoint import committed_steps

    root, config, first = finished_pipeline
    assert first["phase1_only"]["ran"] == ["vocab", "prepare-64", "phase1", "export"]
    # [phase2] added afterwards: no refusal ("made with other settings" before), and only
    # what it adds runs; the export is made again, from phase 2.
    assert first["ran"] == ["prepare-128", "phase2", "export"]
    assert first["skipped"] == ["vocab", "prepare-64", "phase1"]
    assert committed_steps(str(root / "work" / "runs" / "phase1")) == [8]
    assert committed_steps(str(root / "work" / "runs" / "phase2")) == [2, 4]
    record = json.loads((root / "work" / "pipeline.json").read_text())
    assert record["toml"] == TINY_TOML
    assert record["settings"]["recipes"]["phase2"]["max_steps"] == 4
    assert record["settings"]["recipes"]["phase2"]["init_from"] == str(
        root / "work" / "runs" / "phase1")
    assert record["settings"]["config"]["vocab"]["vocab_size"] == 2000


@pytest.mark.slow
def test_export_loads_in_transformers(finished_pipeline):
    import torch
    from transformers import BertForPreTraining, BertTokenizerFast

    root, _, _ = finished_pipeline
    model = BertForPreTraining.from_pretrained(str(root / "work" / "hf")).eval()
    tokenizer = BertTokenizerFast.from_pretrained(str(root / "work" / "hf"))
    batch = tokenizer(["Return the sum of the values."], ["The list must not be empty."],
                      return_tensors="pt")
    with torch.no_grad():
        out = model(**batch)
    assert out.prediction_logits.shape[-1] == len(tokenizer)
    metadata = json.loads((root / "work" / "pipeline.json").read_text())
    assert metadata["stages"]["export"]["source"]["checkpoint"].endswith(
        os.path.join("phase2", "checkpoints", "step_00000004"))


@pytest.mark.slow
def test_rerun_skips_every_stage(finished_pipeline, monkeypatch, capsys):
    root, config, _ = finished_pipeline
    _forbid_work(monkeypatch)
    again = run_pipeline(config)
    assert again["ran"] == []
    assert again["skipped"] == ["vocab", "prepare-64", "prepare-128", "phase1", "phase2",
                                "export"]
    assert capsys.readouterr().out.count("output complete, skipping") == 6


@pytest.mark.slow
def test_a_finished_project_copied_elsewhere_skips_every_stage(finished_pipeline, monkeypatch,
                                                              tmp_path, capsys):
    """The whole project folder (pipeline.toml, corpus, workdir) copied to another place, as
    to another machine: `bertforge pipeline` there finds every stage done. It refused "other
    settings" when the state's absolute paths were compared as they were."""
    import shutil

    from bertforge.cluster.cli import main

    root, _, _ = finished_pipeline
    moved = tmp_path / "elsewhere"
    shutil.copytree(root, moved, symlinks=True)
    _forbid_work(monkeypatch)
    for _ in range(2):  # and again there, once the state says where it is now
        assert main(["pipeline", str(moved / "pipeline.toml")]) == 0
        out = capsys.readouterr().out
        assert out.count("output complete, skipping") == 6, out[-3000:]
        state = json.loads((moved / "work" / "pipeline.json").read_text())
        assert state["base_dir"] == str(moved)


@pytest.mark.slow
def test_a_phase1_deleted_after_phase2_began_is_not_trained_again(finished_pipeline,
                                                                    monkeypatch, tmp_path,
                                                                    capsys):
    """Phase 1's run deleted to free the disk once phase 2 had its checkpoints: the rerun
    trained phase 1 anew (a whole phase), said "done", and every later run was refused
    (phase 1 newer than what phase 2 started from) until phase 2 was thrown away too."""
    from bertforge.cluster.cli import main

    root, _, _ = finished_pipeline
    project = tmp_path / "project"
    shutil.copytree(root, project, symlinks=True)
    phase1 = project / "work" / "runs" / "phase1"
    shutil.rmtree(phase1)
    _forbid_work(monkeypatch)
    for _ in range(2):
        assert main(["pipeline", str(project / "pipeline.toml")]) == 0
        out = capsys.readouterr().out
        assert (f"[pipeline] [4/6] phase1: its run {phase1} is gone, and phase2, warm-started "
                "from its weights, goes on from checkpoints of its own: skipping") in out, out
        assert out.count("output complete, skipping") == 5, out[-3000:]
    # Without phase 2's checkpoints too, phase 1 is trained again, as any missing phase is
    # (here _forbid_work's error: the command's crash, exit 1).
    shutil.rmtree(project / "work" / "runs" / "phase2")
    assert main(["pipeline", str(project / "pipeline.toml")]) == 1
    assert "[pipeline] [4/6] phase1: starting" in capsys.readouterr().out


@pytest.mark.slow
def test_a_deleted_dataset_no_phase_will_read_is_not_made_again(finished_pipeline, monkeypatch,
                                                                tmp_path, capsys):
    """The shards deleted to free the disk once both phases and the export were done: the
    rerun made them again (prepare is the longest stage) for nothing to read them."""
    root, _, _ = finished_pipeline
    project = tmp_path / "project"
    shutil.copytree(root, project, symlinks=True)
    work = project / "work"
    shutil.rmtree(work / "shards-64")
    shutil.rmtree(work / "shards-128")
    _forbid_work(monkeypatch)
    assert main(["pipeline", str(project / "pipeline.toml")]) == 0
    out = capsys.readouterr().out
    for length, phase in ((64, "phase1"), (128, "phase2")):
        assert (f"prepare-{length}: its dataset {work}/shards-{length} is gone, but {phase}, "
                "which trains on it, is done: not making it again") in out, out[-3000:]
    # Phase 2 to train again (its final checkpoint lost): its dataset is made again.
    shutil.rmtree(work / "runs" / "phase2" / "checkpoints" / "step_00000004")
    assert main(["pipeline", str(project / "pipeline.toml")]) == 1  # _forbid_work's crash
    out = capsys.readouterr().out
    assert "prepare-64: its dataset" in out and "[3/6] prepare-128: starting" in out


@pytest.mark.slow
def test_an_edited_or_added_input_is_refused_not_skipped(finished_pipeline, monkeypatch):
    """The shards' manifest is there, but the corpus is no longer what made them: skipping
    would leave the user's edit out of the model without a word."""
    root, config, _ = finished_pipeline
    _forbid_work(monkeypatch)
    corpus = root / "corpus" / "docs.jsonl"
    original = corpus.read_bytes()
    try:
        corpus.write_bytes(original + b'{"id": "late", "text": "A late document. Two."}\n')
        # The vocabulary, trained on them, first (`_vocab_done`) ...
        with pytest.raises(ValueError, match=r"the input files .*vocab\.txt was trained on "
                           r"changed since \(another size: .*docs\.jsonl\), and .*'s shards-64, "
                           r"shards-128, runs/phase1, runs/phase2 and hf were made with it; "
                           r"restore those inputs, or delete them"):
            run_pipeline(config)
        # ... and the shards, where the vocabulary cannot tell (given by path, or recorded
        # before it listed its inputs).
        with monkeypatch.context() as patched:
            patched.setattr("bertforge.cluster.commands.pipeline.vocab_change",
                            lambda *args: "")
            with pytest.raises(ValueError, match=r"shards-64 holds a dataset made from other "
                               r"inputs .*another size: .*docs\.jsonl.*new workdir"):
                run_pipeline(config)
        corpus.write_bytes(original)
        (root / "corpus" / "more.jsonl").write_text('{"id": "m", "text": "More. Text."}\n')
        with pytest.raises(ValueError, match=r"new: .*more\.jsonl"):
            run_pipeline(config)
        (root / "corpus" / "more.jsonl").unlink()
        # Deleted once its shards were made (to save the disk): nothing changed, all skipped.
        corpus.unlink()
        assert run_pipeline(config)["ran"] == []
    finally:
        corpus.write_bytes(original)
        (root / "corpus" / "more.jsonl").unlink(missing_ok=True)
    assert run_pipeline(config)["ran"] == []  # as it was: every stage skipped again


@pytest.mark.slow
def test_a_lost_checkpoint_redoes_only_phase2_and_export(finished_pipeline, monkeypatch):
    from bertforge.training.checkpoint import committed_steps

    """And the last phase trained longer: its max_steps raised in the file (refused as other
    settings before, though `train --resume auto` extends a run)."""
    root, _, _ = finished_pipeline
    phase2 = root / "work" / "runs" / "phase2"
    shutil.rmtree(phase2 / "checkpoints" / "step_00000004")
    monkeypatch.setattr("bertforge.pipelines.prepare.run",
                        lambda *a, **k: pytest.fail("prepare reran"))
    longer = root / "longer.toml"
    longer.write_text(TINY_TOML.replace("max_steps = 4", "max_steps = 6"))
    again = run_pipeline(*load_config(str(longer)), str(root))
    assert again["ran"] == ["phase2", "export"]
    assert committed_steps(str(phase2)) == [4, 6]  # resumed from step 2, not from scratch
    steps_logged = [json.loads(line)["step"] for line in
                    (phase2 / "metrics.jsonl").read_text().splitlines()]
    assert steps_logged.count(1) == 1 and steps_logged[-1] == 6  # step 1 never twice
    assert stages.export_source(str(phase2))["checkpoint"].endswith("step_00000006")
    assert json.loads((root / "work" / "hf" / "config.json").read_text())[
        "bertforge_source"]["global_step"] == 6


@pytest.mark.slow
def test_a_changed_configuration_is_refused_before_any_work(finished_pipeline, monkeypatch):
    root, _, _ = finished_pipeline
    _forbid_work(monkeypatch)
    changed = root / "changed.toml"
    changed.write_text(TINY_TOML.replace("max_steps = 8", "max_steps = 9"))
    config, text = load_config(str(changed))
    with pytest.raises(ValueError, match=r"\[phase1\] overrides.max_steps"):
        run_pipeline(config, text)
    # Phase 2's settings are open only while it has no checkpoint (its length of training
    # always, as the last phase's): now it has one.
    changed.write_text(TINY_TOML.replace("log_every = 2,", "log_every = 2, learning_rate = 0.01,"))
    config, text = load_config(str(changed))
    with pytest.raises(ValueError, match=r"\[phase2\] overrides.learning_rate"):
        run_pipeline(config, text)


@pytest.mark.slow
def test_cadence_may_change_and_a_refusal_offers_the_smallest_remedy(finished_pipeline,
                                                                     monkeypatch, tmp_path,
                                                                     capsys):
    """How often a phase saves and logs could not change once it had a checkpoint, and
    lengthening phase 1 or dropping [phase2] was refused with "delete the workdir" (its
    vocabulary and datasets too), where deleting phase 2's run was enough."""
    root, _, _ = finished_pipeline
    project = tmp_path / "project"
    shutil.copytree(root, project, symlinks=True)
    toml, phase2 = project / "pipeline.toml", project / "work" / "runs" / "phase2"
    _forbid_work(monkeypatch)

    def run(text: str) -> tuple[int, str]:
        toml.write_text(text)
        code = main(["pipeline", str(toml)])
        out, err = capsys.readouterr()
        return code, out + err

    code, out = run(TINY_TOML.replace("log_every = 4 }", "log_every = 2, checkpoint_every = 4, "
                                      "keep_checkpoints = 5, checkpoint_minutes = 5.0 }")
                    .replace("checkpoint_every = 2 }", "checkpoint_every = 1 }"))
    assert code == 0 and out.count("output complete, skipping") == 6, out[-3000:]
    code, out = run(TINY_TOML.replace("max_steps = 8", "max_steps = 12"))
    assert code == 2 and (f"; delete {phase2} to train phase1 to its new length (phase2 "
                          "started from its weights, and starts again from them): the "
                          "vocabulary and the datasets are kept") in out, out[-3000:]
    no_phase2 = TINY_TOML[:TINY_TOML.index("[phase2]")] + TINY_TOML[TINY_TOML.index("[cluster]"):]
    code, out = run(no_phase2)
    assert code == 2 and f"; delete {phase2} to drop phase2: the vocabulary" in out, out[-3000:]
    shutil.rmtree(phase2)  # as offered: each goes on (here to _forbid_work's crash, exit 1)
    code, out = run(TINY_TOML.replace("max_steps = 8", "max_steps = 12"))
    assert code == 1 and "[4/6] phase1: starting" in out, out[-3000:]
    code, out = run(no_phase2)
    assert code == 1 and "[3/4] phase1: output complete" in out and (
        "[4/4] export: starting") in out, out[-3000:]


def test_other_workers_for_a_phase_stopped_part_way_are_refused_where_they_set_the_batch(
        tmp_path):
    """[cluster] workers is how to run; a recipe with no global_batch_size (the tiny ones)
    takes its batch from them: a phase resumed on other workers went on with another batch."""
    step = tmp_path / "work" / "runs" / "phase1" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("{}")
    (step / "bertforge.json").write_text(json.dumps({"world_size": 1}))
    with pytest.raises(ValueError, match=r"^phase1: its run trained on 1 workers \(8 "
                       r"sequences a step\) and \[cluster\] workers = 2 would go on with 16: "
                       "the recipe sets no global_batch_size"):
        check_phases_can_start(config_of(tmp_path, cluster__workers=2, cluster__gpu=True))
    check_phases_can_start(config_of(tmp_path, cluster__workers=1, cluster__gpu=True))
    # A global batch keeps the step whatever the workers; a finished phase trains no more.
    check_phases_can_start(config_of(tmp_path, cluster__workers=2, cluster__gpu=True,
                                     phase1__overrides={"global_batch_size": 16}))
    check_phases_can_start(config_of(tmp_path, cluster__workers=2, cluster__gpu=True,
                                     phase1__overrides={"max_steps": 4}))


def test_a_phase2_of_an_earlier_phase1_is_refused(tmp_path):
    """Phase 1's run deleted and trained anew: phase 2 was done by its own checkpoints and
    skipped, and the export stayed phase 2's, warm-started from the old phase 1."""
    config = config_of(tmp_path, phase2={"recipe": "bert_tiny_phase2", "max_seq_length": 128},
                       cluster__gpu=True)

    def saved(phase: str, run_id: str) -> None:
        step = tmp_path / "work" / "runs" / phase / "checkpoints" / "step_00000020"
        step.mkdir(parents=True)
        (step / "COMMITTED").write_text("{}")
        (step / "bertforge.json").write_text(json.dumps({"run_id": run_id, "world_size": 2}))

    saved("phase1", "20261128T100000.000Z")
    saved("phase2", "20261128T110000.000Z")
    check_phases_can_start(config)  # phase 2 started from phase 1 as it is
    shutil.rmtree(tmp_path / "work" / "runs" / "phase1")
    saved("phase1", "20261128T120000.000Z")
    with pytest.raises(ValueError, match=r"^phase1 was trained anew \(run 20261128T120000.000Z\)"
                       r" after phase2 started from its earlier weights \(run "
                       r"20261128T110000.000Z\): phase 2 and the export hold those; move "):
        check_phases_can_start(config)


def _checkpointed(tmp_path, phase: str):
    step = tmp_path / "work" / "runs" / phase / "checkpoints" / "step_00000008"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text("{}")
    return step.parent.parent


def test_settings_no_output_depends_on_yet_are_free_to_change(tmp_path):
    """A phase that failed at its start (no checkpoint) is run again as corrected: a workdir
    whose vocabulary and shards were made refused the corrected file ("other settings").
    How often a phase saves and logs may change at any time, as `train` takes them on a
    resume; a phase's length while no later phase started from it; a [phase2] dropped while
    it has no checkpoint."""
    from bertforge.cluster.commands.pipeline import settings_free_to_change

    config = config_of(tmp_path, phase2={"recipe": "bert_tiny_phase2", "max_seq_length": 128})

    def free(config):
        keys = settings_free_to_change(config)
        return lambda key: any(key == k or key.startswith(k + ".") for k in keys)

    cadence = [f"{table}.{phase}.{key}" for table, key in (
        ("config", "overrides.checkpoint_every"), ("config", "overrides.keep_checkpoints"),
        ("recipes", "checkpoint_minutes"), ("recipes", "log_every"))
        for phase in ("phase1", "phase2")]
    learning_rate = ["config.phase1.overrides.learning_rate", "recipes.phase2.learning_rate"]
    length = ["config.phase1.overrides.max_steps", "recipes.phase1.warmup_steps",
              "recipes.phase2.max_steps"]
    assert all(map(free(config), cadence + learning_rate + length))
    phase1 = _checkpointed(tmp_path, "phase1")
    is_free = free(config)
    assert all(map(is_free, cadence + length + ["recipes.phase2.learning_rate"]))
    assert not is_free("config.phase1.overrides.learning_rate")
    # Phase 1's run deleted under a phase 2 started from it: phase 1's settings stay fixed,
    # its length too (phase 2 started from its weights); the cadence stays free.
    shutil.move(str(phase1), str(tmp_path / "work" / "runs" / "phase2"))
    is_free = free(config)
    assert all(map(is_free, cadence + ["recipes.phase2.max_steps"]))
    assert not any(map(is_free, learning_rate + ["config.phase1.overrides.max_steps",
                                                 "recipes.phase1.warmup_steps"]))
    # [phase2] dropped: free while its run holds no checkpoint.
    assert not free(config_of(tmp_path))("config.phase2")
    shutil.rmtree(tmp_path / "work" / "runs" / "phase2")
    assert free(config_of(tmp_path))("recipes.phase2.max_steps")


def test_the_smallest_remedy_is_offered(tmp_path):
    """"delete the workdir" threw away the vocabulary and the datasets (hours), where
    deleting a phase's run was enough."""
    from bertforge.cluster.commands.pipeline import smallest_remedy

    both = config_of(tmp_path, phase2={"recipe": "bert_tiny_phase2", "max_seq_length": 128})
    runs = tmp_path / "work" / "runs"
    _checkpointed(tmp_path, "phase1")
    _checkpointed(tmp_path, "phase2")
    kept = ": the vocabulary and the datasets are kept (or use another workdir)"
    assert smallest_remedy(both, ["config.phase1.overrides.max_steps",
                                  "recipes.phase1.max_steps"]) == (
        f"delete {runs / 'phase2'} to train phase1 to its new length (phase2 started from its "
        "weights, and starts again from them)" + kept)
    assert smallest_remedy(both, ["recipes.phase1.learning_rate"]) == (
        f"delete {runs / 'phase1'} and {runs / 'phase2'} to train phase1 and phase2 again as "
        "the file says" + kept)
    assert smallest_remedy(config_of(tmp_path), ["config.phase2", "recipes.phase2"]) == (
        f"delete {runs / 'phase2'} to drop phase2" + kept)
    # What the datasets or the vocabulary depend on: the stage runner's own (a new workdir).
    assert smallest_remedy(both, ["config.prepare.options.dupe_factor",
                                  "recipes.phase1.learning_rate"]) == ""
