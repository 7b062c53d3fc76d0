"""The preparation job's flags (`PrepareOptions`) and their validated form (`PrepareConfig`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if value.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


class PrepareOptions(PipelineOptions):
    """The job's own flags; every other flag goes to Beam (`--runner`, `--direct_num_workers`...).

    Nothing is `required=True` here: Beam parses every PipelineOptions subclass for any pipeline in
    the process, so a required flag would break unrelated pipelines. `PrepareConfig` validates.
    """

    @classmethod
    def _add_argparse_args(cls, parser: Any) -> None:
        parser.add_argument(
            "--input",
            action="append",
            default=None,
            help="corpus file, directory or glob (local, gs://, s3://); repeatable and/or "
            "comma-separated. By extension: .jsonl/.json JSON Lines with 'text'; .parquet with a "
            "'text' column; .xml MediaWiki dump; other: Google's one sentence per line. "
            "A FORMAT: prefix forces a format (books:DIR/*.txt reads one book per file; formats: "
            "jsonl, parquet, wiki, books, sentences). .gz/.bz2 are decompressed.",
        )
        parser.add_argument("--output", default=None, help="dataset directory to write")
        parser.add_argument("--vocab", default=None, help="WordPiece vocab.txt")
        parser.add_argument("--lower_case", type=_parse_bool, nargs="?", const=True, default=True)
        parser.add_argument("--max_seq_length", type=int, default=128)
        parser.add_argument("--short_seq_prob", type=float, default=0.1)
        parser.add_argument(
            "--dupe_factor",
            type=int,
            default=1,
            help="passes over each document with different pairings. Google used 10 to get 10 "
            "static maskings; masking here is dynamic (new every epoch), so 1 suffices.",
        )
        parser.add_argument("--seed", type=int, default=12345)
        parser.add_argument("--validation_fraction", type=float, default=0.05)
        parser.add_argument("--num_shards", type=int, default=4, help="train shards")
        parser.add_argument(
            "--num_validation_shards",
            type=int,
            default=0,
            help="0 = max(1, num_shards // 10): the validation split is ~5%% of the data, so it "
            "gets about a tenth of the shards, at least one",
        )
        parser.add_argument(
            "--random_pool_size",
            type=int,
            default=512,
            help="documents per random-B pool: bounds worker memory, not the corpus size",
        )
        parser.add_argument(
            "--random_pool_chars",
            type=int,
            default=4_000_000,
            help="characters of text per random-B pool (~1M tokens): with --random_pool_size, "
            "bounds worker memory however large the documents are",
        )
        parser.add_argument(
            "--rows_per_piece",
            type=int,
            default=8_192,
            help="instances a worker sorts at once while writing a shard (rounded up to whole "
            "4,096-row batches): bounds worker memory, whatever the shard size; no effect on the "
            "output bytes",
        )


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]
    output: str
    vocab: str
    lower_case: bool = True
    max_seq_length: int = 128
    short_seq_prob: float = 0.1
    dupe_factor: int = 1
    seed: int = 12345
    validation_fraction: float = 0.05
    num_shards: int = 4
    num_validation_shards: int = 0
    random_pool_size: int = 512
    random_pool_chars: int = 4_000_000
    rows_per_piece: int = 8_192  # 2 x 4,096-row batches: ~2 MB of ids at 128 tokens

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("--input is required (a corpus file or glob)")
        if not self.output:
            raise ValueError("--output is required (the dataset directory)")
        if not self.vocab:
            raise ValueError("--vocab is required (a WordPiece vocab.txt)")
        if self.max_seq_length < 5:
            raise ValueError(f"--max_seq_length must be at least 5, got {self.max_seq_length}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"--short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(
                f"--validation_fraction must be in [0, 1), got {self.validation_fraction}"
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
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.num_validation_shards < 0:
            raise ValueError(
                f"--num_validation_shards must be >= 0, got {self.num_validation_shards}"
            )

    @classmethod
    def from_options(cls, options: PipelineOptions) -> PrepareConfig:
        flags = options.view_as(PrepareOptions)
        inputs = tuple(
            p.strip() for entry in flags.input or () for p in entry.split(",") if p.strip()
        )
        return cls(
            inputs=inputs,
            output=flags.output,
            vocab=flags.vocab,
            lower_case=flags.lower_case,
            max_seq_length=flags.max_seq_length,
            short_seq_prob=flags.short_seq_prob,
            dupe_factor=flags.dupe_factor,
            seed=flags.seed,
            validation_fraction=flags.validation_fraction,
            num_shards=flags.num_shards,
            num_validation_shards=flags.num_validation_shards,
            random_pool_size=flags.random_pool_size,
            random_pool_chars=flags.random_pool_chars,
            rows_per_piece=flags.rows_per_piece,
        )

    def shards_per_split(self) -> dict[str, int]:
        """{split: number of shard files}; no validation split when its fraction is 0."""
        counts = {"train": self.num_shards}
        if self.validation_fraction > 0:
            counts["validation"] = self.num_validation_shards or max(1, self.num_shards // 10)
        return counts

    def instance_params(self) -> dict[str, Any]:
        params = asdict(self)
        # rows_per_piece tunes memory only: the same instances and bytes whatever its value.
        for key in ("inputs", "output", "vocab", "rows_per_piece"):
            params.pop(key)
        params["num_validation_shards"] = self.shards_per_split().get("validation", 0)
        return params


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


def help_text() -> str:
    parser = _BeamArgumentParser(prog="bertforge prepare", allow_abbrev=False)
    PrepareOptions._add_argparse_args(parser)
    return parser.format_help() + (
        "\nAny Beam pipeline flag is accepted as well, e.g. --runner DataflowRunner --project P "
        "--region R --temp_location gs://B/tmp, or --direct_num_workers 2 "
        "--direct_running_mode multi_processing.\n"
    )
