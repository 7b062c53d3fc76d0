"""The `bertforge` command line: thin handlers over pipelines/, training/ and cluster/."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Sequence

from bertforge.cluster.launch.paths import refuse_output_in_the_jobs_copy


class CommandParser(argparse.ArgumentParser):
    """A command's parser whose mistakes show a short usage: `[options]`, then what the
    command requires, not every flag it takes (train's full usage is 38 lines, and the error
    line under it scrolled out of sight). `--help` still lists them all."""

    def format_usage(self) -> str:
        needed = [action for action in self._actions
                  if action.required or not action.option_strings]
        formatter = self._get_formatter()
        # Options first: after submit's `-- COMMAND ...` they would be the job's words.
        formatter.add_usage(self.usage, needed, self._mutually_exclusive_groups)
        usage = formatter.format_help().rstrip("\n").replace(
            f"usage: {self.prog}", f"usage: {self.prog} [options]", 1)
        return f"{usage}  (`{self.prog} --help`)\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bertforge",
        description="Pretrain BERT from raw text: Beam preparation, Ray Train + DeepSpeed, "
        "Hugging Face export.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=CommandParser)
    _add_vocab(commands)
    _add_prepare(commands)
    _add_inspect(commands)
    _add_train(commands)
    _add_submit(commands)
    _add_eval(commands)
    _add_export(commands)
    _add_pipeline(commands)
    _add_demo(commands)
    _add_finetune(commands)
    _add_glue(commands)
    from bertforge.cluster.launch.worker_output import ConsoleConfig
    from bertforge.pipelines.contract.config_fields import add_flags

    for command in QUIET_COMMANDS:  # one --verbose, declared once (ConsoleConfig)
        add_flags(commands.choices[command].add_argument_group("console (ConsoleConfig)"),
                  ConsoleConfig)
    for command_parser in commands.choices.values():  # its own usage for its own mistakes
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def refuse_unknown_flags(command_parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 with the command's own usage (not `bertforge`'s) and, for a mistyped flag, the
    nearest one it takes: `train --max-setps 10` -> `did you mean --max-steps?`."""
    known = set(re.findall(r"--[\w-]+", command_parser.format_help()))
    hints = []
    for flag in (word.split("=", 1)[0] for word in extra if word.startswith("--")):
        nearest = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.8)
        if nearest:
            hints.append(f"{flag}: did you mean {nearest[0]}?")
    command_parser.error(f"unrecognized arguments: {' '.join(extra)}"
                         + "".join(f"\n  {hint}" for hint in hints))


# Commands whose console shows the project's own lines only; the engines' output goes to the
# command's log file, and to the console too with --verbose (cluster.launch.worker_output).
QUIET_COMMANDS = ("demo", "train", "finetune", "glue", "eval", "export", "prepare", "pipeline",
                  "vocab")


def _add_vocab(commands) -> None:
    from bertforge.pipelines.contract.config_fields import add_flag, add_flags
    from bertforge.pipelines.vocab_options import VocabConfig

    p = commands.add_parser("vocab", help="train a WordPiece vocabulary on a corpus")
    add_flag(p, VocabConfig, "inputs", required=True, metavar="INPUT")
    add_flag(p, VocabConfig, "output", required=True)
    add_flags(p, VocabConfig)
    p.add_argument("--overwrite", action="store_true",
                   help="replace a vocab.txt already in --output that holds other tokens "
                        "(without it such a run is refused; the same vocabulary again is left "
                        "as it is)")
    p.set_defaults(handler=_run_vocab)


def _add_prepare(commands) -> None:
    from bertforge.cluster.safety.dataset_guard import OVERWRITE_FLAG

    p = commands.add_parser(
        "prepare", help="the Beam job: corpus -> Arrow shards + manifest",
        description="All flags go to the Beam job (pipelines/prepare.py), Beam's own included, "
        "e.g. --runner DataflowRunner --project P --region R. See `bertforge prepare --help`.",
        add_help=False, allow_abbrev=False,
    )
    # The command's own flag (the dataset guard's); every other flag is the job's or Beam's.
    p.add_argument(OVERWRITE_FLAG, action="store_true")
    p.set_defaults(handler=_run_prepare)


def _add_inspect(commands) -> None:
    p = commands.add_parser("inspect", help="statistics and sample pairs of a shard directory")
    p.add_argument("data_dir")
    p.add_argument("--samples", type=int, default=3, help="decoded pairs to show")
    p.add_argument("--verify", action="store_true",
                   help="check every file against the manifest (shards' sha256, rows, tokens; "
                   "the vocabulary's sha256); exit 1 naming each bad file")
    p.set_defaults(handler=_run_inspect)


def _add_train(commands) -> None:
    from bertforge.cluster.launch.launch_config import LaunchConfig
    from bertforge.pipelines.contract.config_fields import add_flag, add_flags
    from bertforge.training.config import TrainConfig
    from bertforge.training.recipes import RECIPES

    p = commands.add_parser(
        "train", help="pretrain on Ray Train workers running DeepSpeed",
        description="Train from a named recipe (--recipe) or from defaults; every flag given "
        "overrides the recipe's value. The resolved recipe is printed and saved in --run-dir.",
    )
    # TrainConfig's fields marked NO_FLAG: data_dir and run_dir first, then the model's size
    # (--preset) and resume (auto|never) from flags of the command's own.
    add_flag(p, TrainConfig, "data_dir", dest="data", required=True)
    add_flag(p, TrainConfig, "run_dir", required=True)
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="a named recipe (training/recipes.py); phase 2 needs --init-from")
    p.add_argument("--preset", choices=("tiny", "mini", "base", "large"), default=None,
                   help="model size (default: the recipe's; else the model of the run it "
                   "resumes, or of --init-from; else tiny)")
    p.add_argument("--resume", default="auto", choices=("auto", "never"),
                   help="auto (the default): continue from the newest complete checkpoint in "
                   "--run-dir, or start there when it has none; never: a new run (an earlier "
                   "run's checkpoints are moved aside to RUN_DIR/previous/)")
    add_flags(p.add_argument_group("training (TrainConfig)"), TrainConfig)
    add_flags(p.add_argument_group("where it runs (LaunchConfig)"), LaunchConfig)
    p.set_defaults(handler=_run_train)


def _add_submit(commands) -> None:
    from bertforge.cluster.launch.submit import DEFAULT_ADDRESS

    p = commands.add_parser(
        "submit", help="run a command as a job on a Ray cluster (Ray Jobs API)",
        description="Submit e.g. `bertforge train ...` to a running Ray cluster, follow its "
        "logs, and exit with its final status (0 succeeded, 1 failed, 3 stopped). Ctrl-C stops "
        "following, not the job (--stop stops it). Paths in the command are the cluster's: "
        "give absolute ones every node mounts. "
        "Usage: bertforge submit [options] -- COMMAND ...",
    )
    p.add_argument("--address", default=None,
                   help="the cluster's Jobs endpoint, its dashboard's http address (default: "
                   f"RAY_API_SERVER_ADDRESS or RAY_ADDRESS where set, else {DEFAULT_ADDRESS})")
    p.add_argument("--working-dir", default=None,
                   help="the job's working directory, uploaded (default: this directory, "
                   "unless the job is a bertforge command and this is no bertforge checkout: "
                   "then nothing); from a bertforge checkout its code runs, else the "
                   "cluster's bertforge")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="more paths to leave out of the upload (repeatable)")
    p.add_argument("--image", default=None,
                   help="a container image holding bertforge, instead of uploading code "
                   "(Ray's image_uri: every node needs Podman and the cluster's Ray and Python "
                   "versions in the image; infra/'s clusters run the training image already)")
    p.add_argument("--submission-id", default=None,
                   help="the job's id (default: Ray's); an id names one job for good, so a "
                   "resubmitted command needs a new one")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for the job (values are never printed)")
    p.add_argument("--no-wait", action="store_true", help="return once submitted")
    p.add_argument("--no-command-check", action="store_true",
                   help="submit a `bertforge COMMAND ...` without first parsing its flags and "
                   "values here (for a cluster whose bertforge, e.g. in --image, differs)")
    p.add_argument("--stop", metavar="SUBMISSION_ID", help="stop a running job instead")
    p.add_argument("--follow", metavar="SUBMISSION_ID",
                   help="follow a job submitted earlier (its logs from the start) to its end "
                   "instead; Ctrl-C stops following, never the job")
    p.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    p.set_defaults(handler=_run_submit)


def _add_eval(commands) -> None:
    from bertforge.pipelines.contract.config_fields import add_flags
    from bertforge.training.eval_options import EvalOptions

    p = commands.add_parser("eval", help="masked-LM and NSP accuracy of a checkpoint")
    p.add_argument("checkpoint", help="a checkpoint directory, a run directory (newest), or a "
                   "Hugging Face BERT directory with the pretraining heads (an export; a "
                   "BertForMaskedLM: masked-LM alone)")
    p.add_argument("--data", required=True, help="prepared shard directory")
    add_flags(p, EvalOptions)
    p.set_defaults(handler=_run_eval)


def _add_export(commands) -> None:
    p = commands.add_parser("export", help="checkpoint -> Hugging Face directory")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (newest)")
    p.add_argument("--output", required=True,
                   help="the Hugging Face directory to write (new, or empty; an earlier export "
                   "of the same checkpoint there is left as it is)")
    p.set_defaults(handler=_run_export)


def _add_pipeline(commands) -> None:
    p = commands.add_parser(
        "pipeline", help="the whole chain from one TOML file, resumable",
        description="vocab -> prepare -> phase 1 -> phase 2 -> export, as CONFIG describes "
        "(see README: 'The whole chain from one file'). Stages whose outputs are complete are "
        "skipped and training resumes where it stopped: after any failure, run it again.",
    )
    p.add_argument("config", help="the pipeline's TOML file")
    p.set_defaults(handler=_run_pipeline)


def _add_demo(commands) -> None:
    from bertforge.cluster.demo import DemoConfig
    from bertforge.pipelines.contract.config_fields import add_flags

    p = commands.add_parser("demo", help="the whole chain on the built-in corpus, in minutes")
    add_flags(p, DemoConfig)
    p.set_defaults(handler=_run_demo)


# `finetune_workers.finetune_launch`'s rule, where the flags' own defaults say otherwise.
FINETUNE_LAUNCH_DEFAULTS = (
    "On one machine (no --address, no --gpu) fine-tuning runs in one process on every core; "
    "--workers N alone splits the cores between N workers. The defaults below are those of a "
    "cluster or --gpu.")


def _add_finetune(commands) -> None:
    from bertforge.cluster.launch.launch_config import FOR_CHECKPOINTS, LaunchConfig
    from bertforge.pipelines.contract.config_fields import add_flags
    from bertforge.training.finetune.config import FinetuneConfig

    p = commands.add_parser(
        "finetune", help="fine-tune a pretrained BERT on a GLUE task or SQuAD",
        description="MODEL is a bertforge checkpoint, a run directory or a Hugging Face BERT "
        "directory. Writes OUTPUT/results.json, dev predictions and the fine-tuned model as a "
        "Hugging Face directory; a rerun into the same OUTPUT reuses finished runs.",
    )
    add_flags(p.add_argument_group("fine-tuning (FinetuneConfig)"), FinetuneConfig)
    add_flags(p.add_argument_group("where it runs (LaunchConfig)", FINETUNE_LAUNCH_DEFAULTS),
              LaunchConfig, without=(FOR_CHECKPOINTS,))  # a fine-tuning run keeps none
    p.set_defaults(handler=_run_finetune)


def _add_glue(commands) -> None:
    from bertforge.cluster.commands.glue import GlueConfig
    from bertforge.cluster.launch.launch_config import FOR_CHECKPOINTS, LaunchConfig
    from bertforge.pipelines.contract.config_fields import add_flags
    from bertforge.training.finetune.config import PER_TASK, FinetuneConfig

    p = commands.add_parser(
        "glue", help="fine-tune on every GLUE task found; one table in the GLUE paper's layout",
        description="Runs `bertforge finetune` for each GLUE task whose files are in --glue-dir "
        "(into OUTPUT/<task>/) and prints one table (dev scores x 100, the average over the "
        "tasks), also in OUTPUT/glue.json; a rerun into the same OUTPUT skips finished tasks.",
    )
    add_flags(p, GlueConfig)
    add_flags(p.add_argument_group("fine-tuning, for every task (FinetuneConfig)"),
              FinetuneConfig, without=(PER_TASK,))  # glue sets those for each task
    add_flags(p.add_argument_group("where it runs (LaunchConfig)", FINETUNE_LAUNCH_DEFAULTS),
              LaunchConfig, without=(FOR_CHECKPOINTS,))
    p.set_defaults(handler=_run_glue)


# --- handlers -----------------------------------------------------------------------------


def _run_vocab(args: argparse.Namespace) -> None:
    from bertforge.pipelines.contract.config_fields import given_values
    from bertforge.pipelines.read.inputs_transform import input_patterns
    from bertforge.pipelines.vocab import train_keeping_another
    from bertforge.pipelines.vocab_options import VocabConfig

    # As prepare takes them: repeated, or comma-separated.
    config = VocabConfig(inputs=input_patterns(args.inputs), output=args.output,
                         **given_values(args, VocabConfig))
    refuse_output_in_the_jobs_copy(config.output, "--output")
    # The datasets and models of a vocab.txt already there read their ids by it: not replaced
    # by other tokens unasked.
    path = train_keeping_another(config, overwrite=args.overwrite)
    _log_in_output_dir(config.output, "vocab")
    print(path)


def _run_prepare(args: argparse.Namespace, extra: list[str]) -> None:
    from bertforge.cluster.commands.guarded_prepare import OVERWRITE_HELP, prepare_guarded
    from bertforge.pipelines.prepare_options import help_text, parse_command_line

    if any(a in ("-h", "--help") for a in extra):
        print(help_text() + OVERWRITE_HELP)
        raise SystemExit(0)
    command = parse_command_line(extra)
    refuse_output_in_the_jobs_copy(command.config.output, "--output")
    # One writer per dataset, no other dataset replaced unasked (--overwrite), none under a run.
    counts = prepare_guarded(command, overwrite=args.overwrite)
    # After the job: a failed first prepare leaves no directory behind (its log goes to the
    # temporary directory, named on the console). A dry run writes nothing, not even OUTPUT.
    _log_in_output_dir(command.config.output, "prepare")
    print(json.dumps(counts, indent=2, ensure_ascii=False))


def _log_in_output_dir(output: str, command: str) -> None:
    """The log of a command that made OUTPUT: OUTPUT/logs/COMMAND.log (the engines' import
    chatter, Beam's among it); in the temporary directory at exit where OUTPUT is in object
    storage or was not made."""
    if "://" not in output and os.path.isdir(output):
        from bertforge.cluster.launch.worker_output import LOG_DIR, log_driver_to

        log_driver_to(os.path.join(output, LOG_DIR, f"{command}.log"))


def _run_inspect(args: argparse.Namespace) -> int:
    from bertforge.pipelines.dataset_stats import format_report, inspect_dataset
    from bertforge.pipelines.verify_dataset import format_verification, verify_dataset

    if args.samples < 0:
        raise ValueError(f"--samples must be at least 0, got {args.samples}")
    if "://" in args.data_dir:  # it said "manifest.json not found" of a dataset that is there
        raise ValueError(f"{args.data_dir}: inspect reads a dataset on this machine (or a "
                         "mounted one), not in object storage; copy it here first (gsutil -m "
                         "cp -r)")
    with _reading_if_there(args.data_dir):
        if args.verify:
            verification = verify_dataset(args.data_dir)
            if not verification.ok:
                print(format_verification(args.data_dir, verification), file=sys.stderr)
                return 1
        stats = inspect_dataset(args.data_dir, num_samples=args.samples)
    print(format_report(stats))
    if args.verify:
        print(format_verification(args.data_dir, verification))
    return 1 if any(split["problems"] for split in stats["splits"].values()) else 0


def _reading_if_there(data_dir: str):
    """inspect reads every shard (--verify hashes them all, for minutes on a large dataset): as
    a reader, like train and eval, so a `prepare --overwrite` meanwhile is refused instead of
    rewriting the shards under it (it reported sha256 and row-count damage that was not
    there), and a prepare already writing it is named. A path that is no folder is left to
    inspect's own one-line error (no folder is made for it)."""
    from bertforge.cluster.safety.dataset_guard import reading_dataset

    return reading_dataset(data_dir, "inspect") if os.path.isdir(data_dir) \
        else contextlib.nullcontext()


def train_config_from_args(args: argparse.Namespace):
    from bertforge.pipelines.contract.config_fields import errors_naming_flags, given_values
    from bertforge.training.config import TrainConfig
    from bertforge.training.recipes import recipe_by_name

    overrides = given_values(args, TrainConfig)
    init_from = overrides.pop("init_from", None)  # a recipe's own argument (phase 2 needs it)
    overrides["resume"] = args.resume == "auto"
    if args.preset:
        overrides["model"] = {"preset": args.preset}
    elif not args.recipe:
        from bertforge.training.warm_start import continued_model

        model = continued_model(init_from, args.run_dir, overrides["resume"])
        if model is not None:
            overrides["model"] = model
    kept = ""
    if overrides["resume"] and not args.recipe:  # a recipe names them all again
        from bertforge.training.resume_settings import (
            changed_settings,
            continued_settings,
            describe,
            describe_changes,
            run_settings,
        )

        recorded = run_settings(args.run_dir)
        continued = continued_settings(recorded, overrides)
        kept = describe(continued)
        if kept:
            print(f"[train] resuming {args.run_dir} with its own settings where this command "
                  f"gives none: {kept}", flush=True)
        # What the command sets otherwise trains from the next step on (a longer --steps, a new
        # --lr); said, as a --mask-prob or --packing given by habit changed the run silently.
        changed = describe_changes(changed_settings(recorded, overrides))
        if changed:
            print(f"[train] resuming {args.run_dir} with this command's {changed}", flush=True)
        overrides = {**continued, **overrides}
    try:
        with errors_naming_flags(TrainConfig):
            if args.recipe:
                return recipe_by_name(args.recipe, args.data, args.run_dir, init_from=init_from,
                                      **overrides)
            return TrainConfig(data_dir=args.data, run_dir=args.run_dir, init_from=init_from,
                               **overrides)
    except ValueError as error:
        if not kept:
            raise
        # A flag given against a setting the run keeps: `--optimizer lamb` on a ZeRO-2 run
        # said "needs zero_stage 0, got 2" of a stage the command never named.
        raise ValueError(f"{error} (this resume keeps the run's own {kept}, where the command "
                         "gives none)") from None


def _train_configs(args: argparse.Namespace):
    from bertforge.cluster.launch.launch_config import LaunchConfig
    from bertforge.pipelines.contract.config_fields import given_values

    cfg = train_config_from_args(args)
    launch = given_values(args, LaunchConfig)
    if "workers" not in launch and cfg.resume and cfg.global_batch_size is None:
        workers = _run_workers(cfg.run_dir)
        if workers is not None and workers != LaunchConfig.workers:
            # A step's batch is workers x micro-batch here: with the default 2 workers a
            # resume of a 1-worker run trained on at twice its batch.
            print(f"[train] resuming {cfg.run_dir} on its own --workers {workers} (a step's "
                  "batch is workers x micro-batch; --workers or --global-batch-size says "
                  "otherwise)", flush=True)
            launch["workers"] = workers
    return cfg, LaunchConfig(**launch)


def _run_workers(run_dir: str) -> int | None:
    """The number of workers the newest checkpoint of `run_dir` was saved by; None without."""
    from bertforge.training import checkpoint

    if not checkpoint.committed_steps(run_dir):
        return None
    try:
        saved = checkpoint.read_metadata(checkpoint.latest_checkpoint(run_dir)).get("world_size")
    except (OSError, ValueError):
        return None  # the run's input checks say what is wrong with it
    return saved if isinstance(saved, int) and saved > 0 else None


def _run_train(args: argparse.Namespace) -> None:
    from bertforge.cluster.launch.ray_train import train_on_ray
    from bertforge.training.inputs import check_phase2_length

    cfg, launch = _train_configs(args)
    check_phase2_length(args.recipe, cfg)  # the recipe's name says what the run is for
    print(json.dumps(train_on_ray(cfg, launch), indent=2, default=str, ensure_ascii=False))


def _run_submit(args: argparse.Namespace) -> int:
    from bertforge.cluster.launch.submit import (
        DEFAULT_EXCLUDES,
        SubmitConfig,
        default_working_dir,
        follow_job,
        jobs_address,
        stop,
        submit,
    )

    address = jobs_address(args.address)  # once: what the command says is where it goes
    entrypoint = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
    if (args.stop or args.follow) and (entrypoint or args.stop and args.follow):
        raise ValueError("give a command to submit, --follow ID or --stop ID: one of them")
    if args.stop:
        return stop(address, args.stop)
    if args.follow:
        return follow_job(address, args.follow)
    working_dir = None if args.image else (args.working_dir or default_working_dir(entrypoint))
    if not args.no_command_check:
        check_submitted_command(entrypoint, uploads=working_dir is not None)
    env_vars = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--env takes NAME=VALUE, got {item!r}")
        env_vars[name] = value
    return submit(SubmitConfig(
        entrypoint=entrypoint, address=address,
        working_dir=working_dir,
        excludes=DEFAULT_EXCLUDES + tuple(args.exclude), image=args.image,
        submission_id=args.submission_id, env_vars=env_vars, follow=not args.no_wait,
    ))


def check_submitted_command(words: list[str], uploads: bool = True) -> None:
    """A submitted `bertforge COMMAND ...` parsed here as the job will parse it, its settings
    built where that needs no file (train, finetune, glue, prepare): a mistyped flag or a bad
    value is refused before anything is uploaded, not once the job runs on the cluster. Paths
    are the cluster's, so none is looked at, but a relative output is refused, and so is a
    relative input where nothing is `uploads`ed for it to be relative to; `--help` is the
    job's to print."""
    from bertforge.cluster.launch.submit import bertforge_arguments

    arguments = bertforge_arguments(words)
    if arguments is None or {"-h", "--help"} & set(arguments):
        return
    unchecked = ("; nothing was submitted (it was checked against this bertforge: "
                 "--no-command-check submits it as it is)")
    try:
        args, extra = build_parser().parse_known_args(arguments)
        paths = args
        if args.command == "prepare":  # its rest is the job's flags and Beam's, as it parses them
            from bertforge.pipelines.prepare_options import parse_command_line

            paths = _prepare_paths(parse_command_line(extra))
        elif extra:
            refuse_unknown_flags(args.command_parser, extra)
        _refuse_relative_outputs(paths, uploads)
        if not uploads:
            _refuse_relative_inputs(paths)
        _refuse_a_private_ray(args)
        if args.command in SETTINGS_OF:
            SETTINGS_OF[args.command](args)
    except SystemExit as refusal:  # argparse's: its usage and message are printed above
        raise ValueError(f"the job's command is refused above{unchecked}") from refusal
    except ValueError as error:
        raise ValueError(f"the job's command: {error}{unchecked}") from None


def _refuse_relative_outputs(args: argparse.Namespace, uploads: bool) -> None:
    """A job's relative --run-dir or --output lands in its working directory on the cluster: a
    temporary copy the job refuses to write into (after the upload and the job's start), or
    wherever Ray starts a job that uploaded none."""
    where = ("a job's working directory is a temporary copy" if uploads else
             "nothing is uploaded, so it would be wherever the cluster's Ray started")
    for what, value in _relative_paths(args, ("run_dir", "output", "storage")):
        raise ValueError(f"{what} {value} is relative: give an absolute path every node mounts "
                         f"({where})")


def _refuse_a_private_ray(args: argparse.Namespace) -> None:
    """Without --address, train, finetune and glue start a Ray of their own (a local run never
    joins a cluster it was not told to): inside a job that is a second Ray on the node the
    job's driver runs on, which trained there alone beside the cluster (and Ray Train's
    placement-group cleaner failed on "Found multiple active Ray instances")."""
    if args.command in ("train", "finetune", "glue") and not getattr(args, "address", None):
        raise ValueError("no --address: the job would start a Ray of its own on the node its "
                         "driver runs on and run there alone, not on the cluster's nodes; add "
                         "--address auto")


def _prepare_paths(command) -> argparse.Namespace:
    """A `PrepareCommand`'s own paths, named as the other commands' flags are (prepare's flags
    are its job's, parsed apart): Beam's flags are Beam's to check."""
    config = command.config
    return argparse.Namespace(inputs=config.inputs, output=config.output, vocab=config.vocab)


# The inputs a submitted command names (flags: vocab's and prepare's --input, a list; and
# inspect's, eval's, export's and pipeline's positional DATA_DIR, CHECKPOINT and CONFIG).
_INPUTS = ("data", "init_from", "model", "train", "dev", "data_root", "glue_dir", "checkpoint",
           "config", "inputs", "vocab", "data_dir")
_POSITIONAL = ("checkpoint", "config", "data_dir")
_FLAGS = {"inputs": "--input"}  # where the flag is not the name's


def _refuse_relative_inputs(args: argparse.Namespace) -> None:
    """With nothing uploaded, a job runs where the cluster's Ray started: a relative input
    resolved there (`../shards` from where `ray start` ran), found missing once the job ran."""
    for what, value in _relative_paths(args, _INPUTS):
        raise ValueError(f"{what} {value} is relative, and nothing is uploaded for it to be "
                         "relative to (this directory is no bertforge checkout; --working-dir "
                         "uploads one): give an absolute path every node mounts")


def _relative_paths(args: argparse.Namespace, names: tuple[str, ...]):
    """(how the command line names it, value) of each local relative path among `names`."""
    for name in names:
        for value in _paths_in(getattr(args, name, None)):
            if value and "://" not in value and not os.path.isabs(value):
                yield _FLAGS.get(name) or (name.upper() if name in _POSITIONAL
                                           else f"--{name.replace('_', '-')}"), value


def _paths_in(value) -> list[str]:
    """A path flag's paths: the value, or of a list of inputs (`--input books:a.txt,b.txt`,
    repeatable) each pattern's path without its FORMAT: prefix."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        return []
    from bertforge.pipelines.read.inputs_transform import input_patterns
    from bertforge.pipelines.read.readers import split_format

    return [split_format(pattern)[1] for pattern in input_patterns(value)]


def _run_eval(args: argparse.Namespace) -> None:
    from bertforge.cluster.safety.dataset_guard import reading_dataset
    from bertforge.pipelines.contract.config_fields import errors_naming_flags, given_values
    from bertforge.training.eval_options import EvalOptions
    from bertforge.training.evaluate import evaluate_checkpoint
    from bertforge.training.inputs import check_eval_inputs, is_hf_model_dir

    with errors_naming_flags(EvalOptions):
        options = EvalOptions(**given_values(args, EvalOptions))
    check_eval_inputs(args.checkpoint, args.data, options.split, options.device)
    if not is_hf_model_dir(args.checkpoint):  # a model's directory is left as it is
        _log_in_run_dir(args.checkpoint, "eval")
    with reading_dataset(args.data, "eval"):  # prepare will not replace it meanwhile
        # The path as given: a run's newest checkpoint is picked where it is read.
        result = evaluate_checkpoint(args.checkpoint, args.data, options)
    print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))


def _run_export(args: argparse.Namespace) -> None:
    from bertforge.training.export import (
        export_already_made,
        export_checkpoint,
        exported_source,
    )
    from bertforge.training.inputs import check_export_inputs

    refuse_output_in_the_jobs_copy(args.output, "--output")
    # The same command again (a scheduler's retry, or a stop after the last file): done.
    source = export_already_made(args.checkpoint, args.output)
    if source is not None:
        _log_in_run_dir(args.checkpoint, "export")  # its log is the run's, as any export's
        print(f"[export] {args.output} already holds this export: nothing to do",
              file=sys.stderr, flush=True)
        output = os.path.abspath(args.output)
    else:
        check_export_inputs(args.checkpoint, args.output)
        _log_in_run_dir(args.checkpoint, "export")
        # The path as given: a run's newest checkpoint is picked where it is read.
        output = export_checkpoint(args.checkpoint, args.output)
        source = exported_source(output)
    # stdout holds the export's path alone (`HF=$(bertforge export ...)`); what it is, stderr.
    print(f"[export] run {source['run_id'] or '(no id: an older run)'}, step "
          f"{source['global_step']}, from {source['checkpoint']}", file=sys.stderr, flush=True)
    print(output)


def _log_in_run_dir(checkpoint_or_run_dir: str, command: str) -> None:
    """eval's and export's log: RUN_DIR/logs/COMMAND.log of the checkpoint's run, beside the
    training's logs (a checkpoint outside a run directory: its own parent's logs/)."""
    from bertforge.cluster.launch.worker_output import LOG_DIR, log_driver_to
    from bertforge.training.checkpoint import COMMIT_MARKER

    path = os.path.abspath(checkpoint_or_run_dir)
    if not os.path.exists(os.path.join(path, COMMIT_MARKER)):
        run_dir = path
    else:
        parent = os.path.dirname(path)
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
    try:
        log_driver_to(os.path.join(run_dir, LOG_DIR, f"{command}.log"))
    except OSError:
        pass  # a read-only run directory: the log goes to the temporary directory at exit


def _run_pipeline(args: argparse.Namespace) -> None:
    from bertforge.cluster.commands.pipeline import load_config, run_pipeline

    config, text = load_config(args.config)
    base_dir = os.path.dirname(os.path.abspath(args.config))
    print(json.dumps(run_pipeline(config, text, base_dir), indent=2, ensure_ascii=False))


def _run_demo(args: argparse.Namespace) -> None:
    from bertforge.cluster.demo import DemoConfig, run_demo
    from bertforge.pipelines.contract.config_fields import given_values

    run_demo(DemoConfig(**given_values(args, DemoConfig)))


def _finetune_launch(args: argparse.Namespace):
    from bertforge.cluster.launch.finetune_workers import finetune_launch
    from bertforge.cluster.launch.launch_config import FOR_CHECKPOINTS, LaunchConfig
    from bertforge.pipelines.contract.config_fields import errors_naming_flags, given_values

    with errors_naming_flags(LaunchConfig):  # "--workers must be at least 1", as train says
        return finetune_launch(given_values(args, LaunchConfig, without=(FOR_CHECKPOINTS,)))


def _finetune_configs(args: argparse.Namespace):
    from bertforge.pipelines.contract.config_fields import errors_naming_flags, given_values
    from bertforge.training.finetune.config import FinetuneConfig

    with errors_naming_flags(FinetuneConfig):
        config = FinetuneConfig(**given_values(args, FinetuneConfig))
    return config, _finetune_launch(args)


def _run_finetune(args: argparse.Namespace) -> None:
    from bertforge.cluster.commands.finetune_sweep import run_finetune

    run_finetune(*_finetune_configs(args))


def _glue_configs(args: argparse.Namespace):
    from bertforge.cluster.commands.glue import GlueConfig
    from bertforge.pipelines.contract.config_fields import given_values
    from bertforge.training.finetune.config import PER_TASK, FinetuneConfig

    finetune = given_values(args, FinetuneConfig, without=(PER_TASK,))
    return GlueConfig(**given_values(args, GlueConfig), finetune=finetune), _finetune_launch(args)


def _run_glue(args: argparse.Namespace) -> None:
    from bertforge.cluster.commands.glue import run_glue

    run_glue(*_glue_configs(args))


# The commands whose settings are built from their flags alone (no file read): what `submit`
# builds to check a job's command, and what their handlers run with.
SETTINGS_OF = {"train": _train_configs, "finetune": _finetune_configs, "glue": _glue_configs}


class _CommandFormatter(logging.Formatter):
    """Our records as the command's own lines ("[demo] prepare: done in 9.7 s"), like its
    printed ones; an engine's record keeps its logger's name ("[ray.train] ...")."""

    def __init__(self, command: str | None) -> None:
        super().__init__("[%(name)s] %(message)s")
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.command and record.name.split(".")[0] == "bertforge":
            # A stage's records name it ("prepare: done"): under the demo or the pipeline
            # that says which stage, under the command of that name it was said twice
            # ("[prepare] prepare: done").
            message = text.removeprefix(f"[{record.name}] ").removeprefix(f"{self.command}: ")
            return f"[{self.command}] {message}"
        return text


def _configure_logging(command: str | None = None) -> None:
    """Our progress lines at INFO, prefixed with the command; the engines' own chatter only from
    WARNING up."""
    logging.basicConfig(level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler:  # basicConfig's, not a test harness's
            handler.setFormatter(_CommandFormatter(command))
    for package in ("bertforge",):
        logging.getLogger(package).setLevel(logging.INFO)


def _home_expanded(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--output=~/x` with the `~` expanded, as the shell expands a word that starts with
    one (and a pipeline file's paths are): it made a folder named `~`. (`--input books:~/x`:
    `input_patterns`.) A submitted command's own words are left to the cluster's bertforge."""
    args, _ = parser.parse_known_args(argv)
    own = len(argv) - len(getattr(args, "entrypoint", None) or ())

    def expanded(word: str) -> str:
        flag, equals, value = word.partition("=")
        if flag.startswith("--") and equals:
            return f"{flag}={expanded(value)}"
        return os.path.expanduser(word) if word.startswith("~") else word

    return [expanded(word) for word in argv[:own]] + argv[own:]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    argv = _home_expanded(argv, parser)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "prepare":  # prepare passes the rest to Beam, which checks it
        refuse_unknown_flags(args.command_parser, extra)  # before any log file or engine
    _configure_logging(args.command)
    if args.command in QUIET_COMMANDS:
        from bertforge.cluster.launch.worker_output import quiet_driver

        quiet_driver(args.command, verbose=bool(args.verbose))
    from bertforge.cluster.launch.local_ray import as_stop, driver_teardown

    try:
        # SIGTERM exits like Ctrl-C (locks released) and a local Ray this run started stops.
        with driver_teardown():
            if args.command == "prepare":
                status = args.handler(args, extra)
            else:
                status = args.handler(args)
    # A path that is a directory, or not one, or not ours to read: the user's to fix, too.
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
            PermissionError) as error:
        from bertforge.cluster.launch.paths import jobs_copy_hint

        return _one_line(args.command, f"error: {error}{jobs_copy_hint(str(error))}", 2)
    except BrokenPipeError:  # `bertforge inspect DIR | head`: the reader has what it wanted
        # stdout to nowhere, or the interpreter's flush at exit raises it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except SystemExit as exit_:  # SIGTERM, SIGINT, SIGHUP: workers stopped, locks released
        stop = as_stop(exit_)
        if stop is None:
            if exit_.code in (0, None):  # prepare's own parser's --help: its text says it all
                from bertforge.cluster.launch.worker_output import ended_with_its_own_line

                ended_with_its_own_line()
            raise
        return _one_line(args.command, stop.describe(), stop.code)
    except Exception as error:
        from bertforge.training.errors import RestartsUsedUp, disk_full

        if disk_full(error):  # what to do is plain; the engine's traceback would hide it
            return _one_line(args.command, f"error: {_disk_full_line(error)}", 2)
        # Printed here, not by the interpreter: importing Ray replaces sys.excepthook with one
        # whose lines the quiet console counts as Ray's (a finetune's crash showed nothing).
        if isinstance(error, RestartsUsedUp):  # the crash's report, then what to do
            if error.__cause__ is not None:  # Ray's; a local worker's output came already
                traceback.print_exception(error.__cause__)
            return _one_line(args.command, f"error: {error}", 1)
        traceback.print_exception(error)
        return 1
    return status or 0  # handlers that run a job return its exit code


def _one_line(command: str, text: str, code: int) -> int:
    """The command's last word, when it ends with one line of its own (a refusal, a stop): no
    engine log is left in $TMPDIR for it (`worker_output.ended_with_its_own_line`)."""
    from bertforge.cluster.launch.worker_output import ended_with_its_own_line

    print(f"bertforge {command}: {text}", file=sys.stderr)
    ended_with_its_own_line()
    return code


def _disk_full_line(error: BaseException) -> str:
    """A full disk in one line: our own message where we raised it (prepare's names the
    output), else the engine's first line with what to do."""
    if isinstance(error, OSError) and error.strerror and "no space left" in error.strerror:
        return error.strerror
    from bertforge.training.errors import first_line

    return (f"no space left on the disk ({first_line(error)}): make room, or write elsewhere, "
            "and run the same command again")


if __name__ == "__main__":
    sys.exit(main())
