"""The preparation job's configuration (`PrepareConfig`) and its command line, parsed once.

`PrepareConfig` is the one place an option is declared: its default, its validation and its help
text. The job's flags and the pipeline file's [prepare] table (`bertforge.cluster.commands.
pipeline`) are generated from its fields (`pipelines.contract.config_fields`).
`parse_command_line` reads a command line once into a `PrepareCommand` (the config, Beam's own
flags, --no-wait) that is passed down; code calls the job with objects,
`prepare.run(config, beam_args)`.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NoReturn

from apache_beam.options.pipeline_options import (
    DirectOptions,
    PipelineOptions,
    SetupOptions,
    StandardOptions,
    TestOptions,
    WorkerOptions,
)

from bertforge.pipelines.contract.config_fields import (
    NOT_IN_FILE,
    RERUN_MAY_CHANGE,
    add_flags,
    field_types,
    flag_spellings,
    given_values,
    negative_spellings,
    option,
    without_marked,
)
from bertforge.pipelines.instances.pairing import check_max_seq_length
from bertforge.pipelines.local.options import LocalRunnerOptions  # its flags are Beam's too
from bertforge.pipelines.read.inputs_transform import input_patterns
from bertforge.pipelines.read.readers import split_format

# A launch choice, not a job option: return once a job that runs elsewhere (Dataflow) is submitted.
NO_WAIT_FLAGS = ("--no-wait", "--no_wait")
NO_WAIT_HELP = (
    "--no-wait (DataflowRunner): return once the job is submitted, printing its id and how to "
    "follow it, instead of waiting for it and printing the manifest's summary.\n"
)

# Where the job reads or writes: the manifest identifies the inputs and the vocabulary by their
# content (input_files, vocab_sha256), so these are no instance parameters.
LOCATION = "location"


@dataclass(frozen=True)
class PrepareConfig:
    """The job's configuration: its flags (`job_parser`), the pipeline file's [prepare] table
    and the manifest's instance parameters are all generated from these fields."""

    inputs: tuple[str, ...] = option(
        (), "corpus files, directories or globs (local, gs://, s3://): several after one "
        "--input, --input repeated, and/or comma-separated. The format is chosen by, in "
        "order: 1) a FORMAT: prefix, taken as given (jsonl, parquet, wiki, wikiextractor, "
        "books, sentences; books:DIR/*.txt reads "
        "one book per file, the only way to get books; a prefix heading a comma-separated "
        "list is the whole list's); 2) the name, past any .gz/.bz2: "
        ".jsonl/.json JSON Lines with 'text', .parquet with a 'text' column, .xml or a "
        "Wikimedia part such as .xml-p1p41242 a MediaWiki dump; 3) otherwise the content: "
        "<mediawiki or <page> -> wiki, a JSON object on the first line -> jsonl, PAR1 -> "
        "parquet, a first line <doc id=...> -> wikiextractor (WikiExtractor's default "
        "output), anything else Google's one sentence per line. A file whose content "
        "contradicts its name (a .jsonl holding XML) is rejected as format_mismatch. "
        "Decompressed by a .gz/.bz2 name, else by gzip/bzip2 magic bytes.",
        flag="--input", marks=(LOCATION,))
    # A pipeline file gives these elsewhere: its own paths, [vocab]'s casing, each phase's length.
    output: str = option("", "dataset directory to write", marks=(LOCATION, NOT_IN_FILE))
    vocab: str = option("", "WordPiece vocab.txt", marks=(LOCATION, NOT_IN_FILE))
    lower_case: bool = option(True, "lower-case and strip accents, as an uncased vocab needs",
                              marks=(NOT_IN_FILE,))
    max_seq_length: int = option(128, "tokens per instance, [CLS] and [SEP]s included",
                                 marks=(NOT_IN_FILE,))
    short_seq_prob: float = option(0.1, "share of instances with a shorter random target length")
    dupe_factor: int = option(
        1, "passes over each document with different pairings. Google used 10 to get 10 "
        "static maskings; masking here is dynamic (new every epoch), so 1 suffices.")
    seed: int = option(12345, "every random choice hashes (seed, a stable key)")
    validation_fraction: float = option(0.05, "share of documents held out for validation")
    num_shards: int = option(4, "train shards")
    num_validation_shards: int = option(
        0, "0 = max(1, num_shards // 10): the validation split is ~5% of the data, so it "
        "gets about a tenth of the shards, at least one")
    random_pool_size: int = option(
        512, "documents per random-B pool: bounds worker memory, not the corpus size")
    random_pool_chars: int = option(
        4_000_000, "characters of text per random-B pool (~1M tokens): with "
        "--random-pool-size, bounds worker memory however large the documents are")
    # 2 x 4,096-row batches: ~2 MB of ids at 128 tokens. It bounds memory and never changes a
    # byte, so a later run may change it.
    rows_per_piece: int = option(
        8_192, "instances a worker sorts at once while writing a shard (rounded up to whole "
        "4,096-row batches): bounds worker memory, whatever the shard size; no effect on the "
        "output bytes", marks=(RERUN_MAY_CHANGE,))

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("inputs are required (--input: a corpus file or glob)")
        if not self.output:
            raise ValueError("output is required (the dataset directory)")
        if not self.vocab:
            raise ValueError("vocab is required (a WordPiece vocab.txt)")
        check_max_seq_length(self.max_seq_length)
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(
                f"validation_fraction must be in [0, 1), got {self.validation_fraction}"
            )
        names = (
            "dupe_factor",
            "num_shards",
            "random_pool_size",
            "random_pool_chars",
            "rows_per_piece",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_validation_shards < 0:
            raise ValueError(
                f"num_validation_shards must be >= 0, got {self.num_validation_shards}"
            )
        if self.num_validation_shards and not self.validation_fraction:
            raise ValueError(
                f"num_validation_shards {self.num_validation_shards} with validation_fraction "
                "0: there is no validation split to shard (give a fraction, or leave the "
                "shards out)")

    def shards_per_split(self) -> dict[str, int]:
        """{split: number of shard files}; no validation split when its fraction is 0."""
        counts = {"train": self.num_shards}
        if self.validation_fraction > 0:
            counts["validation"] = self.num_validation_shards or max(1, self.num_shards // 10)
        return counts

    def instance_params(self) -> dict[str, Any]:
        """What decides the instances, as the manifest records it (not where the job reads and
        writes, nor how it runs)."""
        params = without_marked(asdict(self), PrepareConfig, LOCATION, RERUN_MAY_CHANGE)
        params["num_validation_shards"] = self.shards_per_split().get("validation", 0)
        return params


@dataclass(frozen=True)
class PrepareCommand:
    """One `prepare` command line, parsed once (`parse_command_line`): the job's configuration,
    Beam's own flags (`--runner`, `--direct_num_workers`, ...) and whether to wait for a job
    that runs elsewhere (`--no-wait`: Dataflow)."""

    config: PrepareConfig
    beam_args: tuple[str, ...] = ()
    wait: bool = True

    @functools.cached_property
    def options(self) -> PipelineOptions:
        """Beam's flags as Beam's options object, built once (`parse_command_line` checked
        them); the job's run reads and completes this one (its runner default)."""
        return beam_options(self.beam_args)

    @property
    def dry_run(self) -> bool:
        return bool(self.options.view_as(TestOptions).dry_run)

    @property
    def quiet(self) -> bool:
        return bool(self.options.view_as(LocalRunnerOptions).quiet)


def beam_options(beam_args: Sequence[str]) -> PipelineOptions:
    """Beam's options object of its flags. `--direct_num_workers N` alone (N > 1) means N
    worker processes: Beam's default running mode, in_memory, would run one and say so only in
    the log."""
    options = PipelineOptions(list(beam_args))
    test = options.view_as(TestOptions)
    if isinstance(test.dry_run, str):  # Beam keeps the text: "False" was true, a dry run
        test.dry_run = _true_or_false("--dry_run", test.dry_run)
    direct = options.view_as(DirectOptions)
    if (direct.direct_num_workers or 0) > 1 and not any(
            arg.split("=", 1)[0] == "--direct_running_mode" for arg in beam_args):
        direct.direct_running_mode = "multi_processing"
    return options


def _true_or_false(flag: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError(f"{flag}={text}: give True or False")


def is_dataflow(runner: str) -> bool:
    """Whether `runner` (Beam's --runner) sends the job to Google Cloud Dataflow."""
    return "Dataflow" in runner


def dataflow_problems(config: PrepareConfig, options: PipelineOptions) -> list[str]:
    """What makes a Dataflow job fail or lose its output, known before it is sent: paths on
    this machine, which Dataflow's workers cannot read (inputs) or write somewhere that lasts
    (the output: each worker's own disk, gone with it), and workers without bertforge (Beam's
    stock image). The vocabulary may be local: this process reads it into the job."""
    problems = [f"--input {pattern} is on this machine, where Dataflow's workers cannot read "
                "it: copy it to gs:// (or s3://)"
                for pattern in config.inputs if "://" not in split_format(pattern)[1]]
    if "://" not in config.output:
        problems.append(f"--output {config.output} is on this machine: Dataflow's workers "
                        "would write the shards to their own disks, lost when they stop; give "
                        "a gs:// output")
    setup = options.view_as(SetupOptions)
    if not (options.view_as(WorkerOptions).sdk_container_image or setup.extra_packages
            or setup.setup_file):
        problems.append("the workers would run Beam's stock image, which has no bertforge: "
                        "give --sdk_container_image (the image of infra/dataflow/Dockerfile) "
                        "or --extra_package dist/bertforge-0.1.0.tar.gz (`python -m build "
                        "--sdist`)")
    return problems


def parse_command_line(argv: Sequence[str]) -> PrepareCommand:
    """The command line (`bertforge prepare`, a Flex Template's launcher), parsed once; a
    flag that neither the job nor Beam knows, a missing or bad value: one ValueError."""
    parser = job_parser()
    parsed, beam_args = parser.parse_known_args(list(argv))
    check_beam_args(beam_args)
    values = given_values(parsed, PrepareConfig)
    values["inputs"] = input_patterns(values.get("inputs", ()))
    command = PrepareCommand(PrepareConfig(**values), tuple(beam_args), wait=not parsed.no_wait)
    runner = command.options.view_as(StandardOptions).runner or "DirectRunner"
    if parsed.no_wait and not is_dataflow(runner):  # it ran and waited all the same
        raise ValueError(f"--no-wait is for a job that runs elsewhere (DataflowRunner); "
                         f"{runner} runs it in this process, to its end")
    return command


class _RefusingParser(argparse.ArgumentParser):
    """A bad value (`--num-shards=abc`) is the command's one-line error, not argparse's exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def job_parser() -> argparse.ArgumentParser:
    """The job's own flags (one per `PrepareConfig` field, in Beam's spellings too) and
    --no-wait; everything else is Beam's."""
    parser = _RefusingParser(prog="bertforge prepare", allow_abbrev=False, add_help=False)
    add_flags(parser, PrepareConfig, beam=True)
    parser.add_argument(*NO_WAIT_FLAGS, dest="no_wait", action="store_true")
    return parser


def job_flags() -> tuple[str, ...]:
    """Every flag the job owns, in both spellings (`--input`, `--max-seq-length`,
    `--max_seq_length`, ...)."""
    kinds = field_types(PrepareConfig)
    return tuple(flag for f in fields(PrepareConfig)
                 for flag in (*flag_spellings(f, beam=True),
                              *negative_spellings(f, kinds[f.name], beam=True)))


def _beam_parser() -> argparse.ArgumentParser:
    """A parser of every flag Beam knows (its options and the local runner's), as Beam builds
    it for a pipeline: handed over by Beam's public hook, so no private name is borrowed."""
    built: list[argparse.ArgumentParser] = []
    PipelineOptions([]).get_all_options(add_extra_args_fn=built.append)
    parser = built[0]
    # A bad value (`--direct_num_workers two`) is one line like any other mistake, not Beam's
    # 129-line usage and an exit from inside the check.
    parser.error = _raise_value_error
    return parser


def _raise_value_error(message: str) -> NoReturn:
    raise ValueError(message)


def check_beam_args(beam_args: Sequence[str]) -> None:
    """Beam's own flags only: the job's options come from the config object, and a flag Beam
    does not know is one clear error. (Beam itself only logs "Discarding unparseable args" and
    goes on, so a typo, `--num_shard 64`, would silently run with the default.)"""
    owned = [a for a in beam_args if a.split("=", 1)[0] in job_flags()]
    if owned:
        raise ValueError(f"Beam arguments must not set the job's own options "
                         f"({', '.join(owned)}): they come from the configuration")
    # Beam's parser would print its own help and exit: here --help is a flag out of place.
    asked_help = [a for a in beam_args if a in ("-h", "--help")]
    known, unknown = _beam_parser().parse_known_args(
        [a for a in beam_args if a not in asked_help])
    if isinstance(getattr(known, "dry_run", None), str):
        _true_or_false("--dry_run", known.dry_run)  # its one error, before anything runs
    unknown = asked_help + unknown
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    if flags:
        raise ValueError(
            f"unknown flag(s) {' '.join(flags)}: see `bertforge prepare --help` for the job's "
            "flags; any Beam pipeline flag (--runner, --project, ...) is accepted too"
        )
    if unknown:
        raise ValueError(
            f"unexpected argument(s) {' '.join(unknown)}: flags look like --name=value"
        )


def help_text() -> str:
    parser = argparse.ArgumentParser(prog="bertforge prepare", allow_abbrev=False)
    add_flags(parser, PrepareConfig, beam=True)
    LocalRunnerOptions.add_flags(parser.add_argument_group("local runs"))
    return parser.format_help() + (
        "\nAny Beam pipeline flag is accepted as well, e.g. --runner DataflowRunner --project P "
        "--region R --temp_location gs://B/tmp, or --direct_num_workers 2 "
        "--direct_running_mode multi_processing.\n"
        "--dry_run=True translates the pipeline and lists the inputs found and their formats, "
        "without running or writing anything.\n"
    ) + NO_WAIT_HELP


# Cloud Storage's bucket names: 3-63 lower-case letters, digits, "-", "_" and "."; a letter or
# digit at both ends. A name outside them (the README's placeholder `gs://BUCKET/tmp`) makes
# the Dataflow client retry for minutes and fail in a 190-line traceback.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")


def check_gcs_paths(named_paths: list[tuple[str, str | None]]) -> None:
    """[(flag, path)]: every gs:// path names a valid bucket, else one ValueError naming it."""
    for flag, path in named_paths:
        if not path or not path.startswith("gs://"):
            continue
        bucket = path[len("gs://"):].split("/", 1)[0]
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"{flag} {path}: {bucket!r} is not a Cloud Storage bucket name "
                             "(3-63 lower-case letters, digits, '-', '_' or '.'); give a "
                             "bucket of your project")
