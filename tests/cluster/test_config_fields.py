"""One source of truth per job's configuration: every field of every job's config reaches the
command line and the pipeline file, with its help, and a flag's value reaches the config."""

import dataclasses

import pytest

from bertforge.cluster.cli import build_parser, train_config_from_args
from bertforge.cluster.commands.glue import GlueConfig
from bertforge.cluster.commands.pipeline import PhaseSection, PipelineConfig
from bertforge.cluster.demo import DemoConfig
from bertforge.cluster.launch.launch_config import LaunchConfig
from bertforge.cluster.launch.worker_output import ConsoleConfig
from bertforge.pipelines.contract.config_fields import NO_FLAG, NOT_IN_FILE, marked
from bertforge.pipelines.prepare_options import PrepareConfig, parse_command_line
from bertforge.pipelines.vocab_options import VocabConfig
from bertforge.training.config import TrainConfig
from bertforge.training.engine_config import EngineConfig
from bertforge.training.eval_options import EvalOptions
from bertforge.training.finetune.config import FinetuneConfig

# The flags `bertforge train` places itself for the TrainConfig fields marked NO_FLAG.
HAND_FLAGS = {"data_dir": "--data", "run_dir": "--run-dir", "model": "--preset",
              "resume": "--resume"}


def _subparser(name: str):
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return commands.choices[name]


def _flags_by_dest(parser) -> dict[str, set[str]]:
    flags: dict[str, set[str]] = {}
    for action in parser._actions:
        flags.setdefault(action.dest, set()).update(action.option_strings)
    return flags


@pytest.mark.parametrize("cls", [TrainConfig, LaunchConfig, PrepareConfig, DemoConfig,
                                 FinetuneConfig, GlueConfig, ConsoleConfig, VocabConfig,
                                 EvalOptions])
def test_every_field_has_help_text(cls):
    missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{cls.__name__} fields without help: {missing}"


def test_every_training_and_launch_field_has_a_train_flag():
    flags = _flags_by_dest(_subparser("train"))
    for f in dataclasses.fields(TrainConfig):
        if marked(f, NO_FLAG):
            assert HAND_FLAGS[f.name] in {s for fs in flags.values() for s in fs}, f.name
        else:
            assert flags.get(f.name), f"TrainConfig.{f.name} has no `bertforge train` flag"
    for f in dataclasses.fields(LaunchConfig):
        assert flags.get(f.name), f"LaunchConfig.{f.name} has no `bertforge train` flag"
    assert {f.name for f in dataclasses.fields(TrainConfig) if marked(f, NO_FLAG)} == \
        set(HAND_FLAGS)


def test_vocab_options_are_one_declaration_with_one_spelling(tmp_path):
    """`bertforge vocab` flags and the pipeline file's [vocab] keys are VocabConfig's fields:
    the flag spelled `--cased` and the key `lower_case` were one option with two names."""
    from bertforge.cluster.commands.pipeline import VocabSection

    flags = _flags_by_dest(_subparser("vocab"))
    for f in dataclasses.fields(VocabConfig):
        assert flags.get(f.name), f"VocabConfig.{f.name} has no `bertforge vocab` flag"
    assert flags["lower_case"] == {"--lower-case", "--no-lower-case"}
    assert flags["vocab_size"] == {"--vocab-size"}
    section = {f.name: f for f in dataclasses.fields(VocabSection)}
    for f in dataclasses.fields(VocabConfig):
        if not marked(f, NOT_IN_FILE):
            assert section[f.name].metadata["help"] == f.metadata["help"], f.name
            assert section[f.name].default == f.default, f.name
    args = build_parser().parse_args(["vocab", "--input", "a.txt", "b.txt", "--output", "o",
                                      "--no-lower-case", "--vocab-size", "100"])
    from bertforge.pipelines.contract.config_fields import given_values

    config = VocabConfig(inputs=tuple(args.inputs), output=args.output,
                         **given_values(args, VocabConfig))
    assert config == VocabConfig(("a.txt", "b.txt"), "o", vocab_size=100, lower_case=False)


def test_eval_flags_are_the_eval_options():
    flags = _flags_by_dest(_subparser("eval"))
    for f in dataclasses.fields(EvalOptions):
        assert bool(flags.get(f.name)) != marked(f, NO_FLAG), f"EvalOptions.{f.name}"
    args = build_parser().parse_args(["eval", "run", "--data", "d", "--batch-size", "8",
                                      "--no-verify-checksums"])
    from bertforge.pipelines.contract.config_fields import given_values

    assert EvalOptions(**given_values(args, EvalOptions)) == EvalOptions(
        batch_size=8, verify_checksums=False)


def test_pretraining_and_fine_tuning_offer_the_engines_options_as_declared_there():
    """One declaration per engine option: TrainConfig holds every EngineConfig field (its
    `engine()` reads them by name); each option a job offers is EngineConfig's, help and
    default alike (fine-tuning may narrow the choices)."""
    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    train_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert set(engine_fields) <= set(train_fields)
    for cls in (TrainConfig, FinetuneConfig):
        for f in dataclasses.fields(cls):
            declared = engine_fields.get(f.name)
            if declared is None or not declared.metadata.get("help"):
                continue  # not an engine option (the run's steps, batch, learning rate)
            assert f.metadata["help"] == declared.metadata["help"], f"{cls.__name__}.{f.name}"
            assert f.default == declared.default, f"{cls.__name__}.{f.name}"
            assert set(f.metadata.get("choices", ())) <= set(declared.metadata.get("choices",
                                                                                   ()))


def test_the_demos_training_defaults_are_the_demo_recipes():
    from bertforge.training.recipes import demo_recipe

    recipe, demo = demo_recipe("d", "r"), DemoConfig()
    assert (demo.max_steps, demo.micro_batch_size, demo.learning_rate, demo.precision) == (
        recipe.max_steps, recipe.micro_batch_size, recipe.learning_rate, recipe.precision)


def test_every_demo_field_has_a_demo_flag():
    flags = _flags_by_dest(_subparser("demo"))
    for f in dataclasses.fields(DemoConfig):
        assert flags.get(f.name), f"DemoConfig.{f.name} has no `bertforge demo` flag"


def test_every_prepare_field_has_a_job_flag_and_a_pipeline_key_or_owner(tmp_path):
    from bertforge.pipelines.prepare_options import job_parser

    flags = _flags_by_dest(job_parser())
    table = {"inputs": ["a.jsonl"]}
    for f in dataclasses.fields(PrepareConfig):
        assert flags.get(f.name), f"PrepareConfig.{f.name} has no `bertforge prepare` flag"
        if not marked(f, NOT_IN_FILE) and f.name != "inputs":  # inputs: given above
            table[f.name] = getattr(PrepareConfig(inputs=("x",), output="o", vocab="v"), f.name)
    # Every field not owned by the pipeline is a key of its [prepare] table.
    config = PipelineConfig.from_dict(
        {"workdir": "w", "prepare": table,
         "phase1": {"recipe": "bert_tiny_phase1", "max_seq_length": 64}}, str(tmp_path))
    assert config.prepare.options.max_seq_length == 64


def test_every_training_field_is_a_phase_override_or_owned_by_the_pipeline():
    for f in dataclasses.fields(TrainConfig):
        if marked(f, NOT_IN_FILE):
            continue
        value = getattr(TrainConfig(data_dir="d", run_dir="r"), f.name)
        PhaseSection("phase1", "bert_tiny_phase1", 64, {f.name: value})  # no error


def test_every_launch_field_is_a_cluster_key(tmp_path):
    table = {f.name: getattr(LaunchConfig(), f.name) for f in dataclasses.fields(LaunchConfig)}
    table["address"] = ""  # TOML has no null: "" is a local Ray
    table["storage"] = "gs://bucket/runs"
    config = PipelineConfig.from_dict(
        {"workdir": "w", "prepare": {"inputs": ["a"]}, "cluster": table,
         "phase1": {"recipe": "bert_tiny_phase1", "max_seq_length": 64}}, str(tmp_path))
    assert config.cluster.address is None and config.cluster.storage == "gs://bucket/runs"


def test_train_flags_reach_the_config_and_leave_the_rest_to_the_recipe():
    args = build_parser().parse_args([
        "train", "--data", "d", "--run-dir", "r", "--recipe", "bert_base_phase1",
        "--steps", "7000", "--adam-betas", "0.8", "0.9", "--whole-word-masking",
        "--resume", "never", "--workers", "4", "--no-gpu",
    ])
    cfg = train_config_from_args(args)
    assert cfg.max_steps == 7000 and cfg.adam_betas == (0.8, 0.9) and cfg.whole_word_masking
    assert not cfg.resume
    assert cfg.global_batch_size == 4096  # the recipe's, no flag given
    # The recipe's warm-up share (3,000 of 56,250 steps), not the default of 10 % of max_steps.
    assert cfg.warmup_steps == round(3000 * 7000 / 56_250) == 373
    plain = train_config_from_args(build_parser().parse_args(
        ["train", "--data", "d", "--run-dir", "r", "--max-steps", "300"]))
    assert plain.warmup_steps == 30 and plain.log_every == 15  # the one default of each
    assert args.workers == 4 and args.gpu is False


def test_prepare_argv_splits_into_the_config_and_beams_flags():
    command = parse_command_line([
        "--input=a.jsonl,b.jsonl", "--input", "c.xml", "--output=o", "--vocab=v",
        "--lower_case=false", "--num_shards=9", "--runner=DirectRunner",
        "--direct_num_workers=2",
    ])
    config, beam_args = command.config, list(command.beam_args)
    assert config.inputs == ("a.jsonl", "b.jsonl", "c.xml")
    assert config.num_shards == 9 and not config.lower_case
    assert config.max_seq_length == PrepareConfig.max_seq_length  # the dataclass's default
    assert beam_args == ["--runner=DirectRunner", "--direct_num_workers=2"]


def test_a_resume_says_the_switches_it_keeps_as_they_are_typed():
    """The resume's line said `--packing True` and `--verify-checksums False`, which the
    command line does not take (`--packing`, `--no-verify-checksums`)."""
    from bertforge.training.resume_settings import describe

    said = describe({"packing": True, "verify_checksums": False, "max_steps": 6,
                     "whole_word_masking": False})  # the default: not said
    assert said == "--packing, --no-verify-checksums, --max-steps 6"
    args = build_parser().parse_args(["train", "--data", "d", "--run-dir", "r",
                                      *said.replace(",", "").split()])
    assert (args.packing, args.verify_checksums, args.max_steps) == (True, False, 6)
