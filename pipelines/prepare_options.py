"""The preparation job's configuration (`PrepareConfig`) and the flags generated from it.

`PrepareConfig` is the one place an option is declared: its default, its validation and its help
text. `PrepareOptions` (the Beam options the command line and a Flex Template parse) and the
pipeline file's [prepare] table (`bertforge.cluster.pipeline`) are generated from its fields
(`pipelines.contract.config_fields`). Code calls the job with objects,
`prepare.run(config, beam_args)`; argv exists only at the command line.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

from bertforge.pipelines.contract.config_fields import (
    NOT_IN_FILE,
    RERUN_MAY_CHANGE,
    add_flags,
    flag_spellings,
    given_values,
    option,
    without_marked,
)
from bertforge.pipelines.instances.pairing import MIN_SEQ_LENGTH
from bertforge.pipelines.local.options import LocalRunnerOptions  # its flags are Beam's too

# Where the job reads or writes: the manifest identifies the inputs and the vocabulary by their
# content (input_files, vocab_sha256), so these are no instance parameters.
LOCATION = "location"


@dataclass(frozen=True)
class PrepareConfig:
    """The job's configuration: its flags (`PrepareOptions`), the pipeline file's [prepare]
    table and the manifest's instance parameters are all generated from these fields."""

    inputs: tuple[str, ...] = option(
        (), "corpus file, directory or glob (local, gs://, s3://); repeatable and/or "
        "comma-separated. The format is chosen by, in order: 1) a FORMAT: prefix, taken as "
        "given (jsonl, parquet, wiki, books, sentences; books:DIR/*.txt reads one book per "
        "file, the only way to get books); 2) the name, past any .gz/.bz2: .jsonl/.json JSON "
        "Lines with 'text', .parquet with a 'text' column, .xml or a Wikimedia part such as "
        ".xml-p1p41242 a MediaWiki dump; 3) otherwise the content: <mediawiki or <page> -> "
        "wiki, a JSON object on the first line -> jsonl, PAR1 -> parquet, anything else "
        "Google's one sentence per line. A file whose content contradicts its name (a .jsonl "
        "holding XML) is rejected as format_mismatch. Decompressed by a .gz/.bz2 name, else "
        "by gzip/bzip2 magic bytes.", flag="--input", marks=(LOCATION,))
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
        if self.max_seq_length < MIN_SEQ_LENGTH:
            raise ValueError(f"max_seq_length must be at least {MIN_SEQ_LENGTH} ([CLS] A [SEP] B "
                             f"[SEP]), got {self.max_seq_length}")
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

    @classmethod
    def from_options(cls, options: PipelineOptions) -> PrepareConfig:
        """The config from parsed flags; a flag left out keeps the field's default."""
        values = given_values(options.view_as(PrepareOptions), cls)
        values["inputs"] = tuple(
            p.strip() for entry in values.get("inputs", ()) for p in entry.split(",") if p.strip()
        )
        return cls(**values)

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


class PrepareOptions(PipelineOptions):
    """The job's own flags, one per `PrepareConfig` field; every other flag goes to Beam
    (`--runner`, `--direct_num_workers`...).

    Nothing is `required=True` and no flag has a default here: Beam parses every
    PipelineOptions subclass for any pipeline in the process, so a required flag would break
    unrelated pipelines, and the dataclass holds the one default (shown in the help).
    """

    @classmethod
    def _add_argparse_args(cls, parser: Any) -> None:
        add_flags(parser, PrepareConfig, beam=True)


def job_flags() -> tuple[str, ...]:
    """Every flag the job owns, in both spellings (`--input`, `--max-seq-length`,
    `--max_seq_length`, ...)."""
    return tuple(flag for f in fields(PrepareConfig) for flag in flag_spellings(f, beam=True))


def _all_options_parser() -> Any:
    """A parser of every flag Beam knows (its own options and ours), as Beam builds it."""
    parser = _BeamArgumentParser(allow_abbrev=False, add_help=False)
    seen: dict[str, type] = {}
    for cls in PipelineOptions.__subclasses__():
        seen.setdefault(str(cls), cls)
    for cls in seen.values():
        cls._add_argparse_args(parser)
    return parser


def check_argv(argv: list[str]) -> None:
    """One clear error for a flag neither the job nor Beam knows.

    Beam only logs "Discarding unparseable args" and goes on, so a typo (`--num_shard 64`) would
    silently run with the default.
    """
    _, unknown = _all_options_parser().parse_known_args(argv)
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


def parse_argv(argv: list[str]) -> tuple[PrepareConfig, list[str]]:
    """The command line split into the job's config and the flags that go to Beam."""
    check_argv(argv)
    parser = _BeamArgumentParser(allow_abbrev=False, add_help=False)
    PrepareOptions._add_argparse_args(parser)
    _, beam_args = parser.parse_known_args(argv)
    return PrepareConfig.from_options(PipelineOptions(argv)), beam_args


def check_beam_args(beam_args: list[str]) -> None:
    """Beam's own flags only: the job's options come from the config object."""
    owned = [a for a in beam_args if a.split("=", 1)[0] in job_flags()]
    if owned:
        raise ValueError(f"Beam arguments must not set the job's own options "
                         f"({', '.join(owned)}): they come from the configuration")
    check_argv(beam_args)


def help_text() -> str:
    parser = _BeamArgumentParser(prog="bertforge prepare", allow_abbrev=False)
    PrepareOptions._add_argparse_args(parser)
    LocalRunnerOptions._add_argparse_args(parser.add_argument_group("local runs"))
    return parser.format_help() + (
        "\nAny Beam pipeline flag is accepted as well, e.g. --runner DataflowRunner --project P "
        "--region R --temp_location gs://B/tmp, or --direct_num_workers 2 "
        "--direct_running_mode multi_processing.\n"
        "--dry_run=True translates the pipeline and lists the inputs found and their formats, "
        "without running or writing anything.\n"
    )


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
