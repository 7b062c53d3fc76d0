"""The preparation job: corpus files -> documents -> sentence-pair instances -> Arrow shards.

    inputs --ReadInputs--> raw documents --CreatePretrainingInstances--> keyed instances
           --WriteShards--> train/*.arrow, validation/*.arrow
    rejects --WriteRejects--> rejects.jsonl
    all of the above --WriteManifest--> vocab.txt, manifest.json (last)

One sub-package per stage, in the order the data flows: `read/` (files -> raw documents:
`inputs_transform.ReadInputs`), `instances/` (documents -> sentence-pair instances:
`pairs_transform.CreatePretrainingInstances`), `write/` (global order and shard files:
`shards_transform.WriteShards`; rejects, vocab and manifest: `manifest_transform.WriteManifest`).
`contract/` (`manifest`, `tokenization`) is what training reads back and imports no Beam;
`prepare_options` holds the config (`PrepareConfig`) and the flags generated from it,
`beam_common` the metrics namespace and rejects output shared by every step.

Every decision hashes (seed, a stable key), and every group is sorted before use, so shards are
byte-identical for any runner and number of workers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import (
    GoogleCloudOptions,
    PipelineOptions,
    StandardOptions,
    TestOptions,
)
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.pvalue import AsSingleton

from bertforge.pipelines import job_report, local_job
from bertforge.pipelines.beam_common import (
    INSTANCES,
    JOB_REFUSALS,
    METRICS_NAMESPACE,
    RANDOM_NEXT,
    REJECTS,
    TOKENIZED_PIECES,
    UNKNOWN_PIECES,
)
from bertforge.pipelines.contract import manifest
from bertforge.pipelines.contract.tokenization import parse_vocab
from bertforge.pipelines.filesystem import read_bytes
from bertforge.pipelines.instances.pairs_transform import (  # noqa: F401  (re-exported: the job's public names)
    CreatePretrainingInstances,
    Doc,
    pool_of,
    split_of,
)
from bertforge.pipelines.prepare_options import (
    PrepareCommand,
    PrepareConfig,
    beam_options,
    check_beam_args,
    check_gcs_paths,
    dataflow_problems,
    help_text,
    is_dataflow,
    parse_command_line,
)
from bertforge.pipelines.read.inputs_transform import FORMATS, ReadInputs, match_inputs
from bertforge.pipelines.read.readers import split_format
from bertforge.pipelines.write.manifest_transform import WriteManifest, write_rejects_file
from bertforge.pipelines.write.shards_transform import WriteShards

logger = logging.getLogger(__name__)


class _WithoutWorkerStartNotice(logging.Filter):
    """Beam's local job service relays each SDK worker's start-up WARN that it has no
    semi_persistent_directory (a Dataflow worker's cache dir; nothing of ours registers objects
    there): two 400-character lines per local run, on the console of every prepare and demo."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No semi_persistent_directory found" not in record.getMessage()


logging.getLogger("apache_beam.runners.portability.local_job_service").addFilter(
    _WithoutWorkerStartNotice())


class PrepareDataset(beam.PTransform):
    """The whole job on a pipeline: read, create instances, write shards, rejects and manifest."""

    def __init__(
        self, config: PrepareConfig, files: list[tuple[str, str | None]], vocab_bytes: bytes
    ):
        super().__init__()
        self._config = config
        self._files = files
        self._vocab_bytes = vocab_bytes
        self._vocab_size = len(parse_vocab(vocab_bytes))

    def expand(self, pbegin):
        config = self._config
        read = pbegin | "ReadInputs" >> ReadInputs(self._files)
        # Every input record is a document or a read reject (repairs are notes on kept records):
        # the manifest's accounting starts here.
        dropped_at_read = read[REJECTS] | "DroppedAtRead" >> beam.Filter(lambda r: not r.repaired)
        # Counted as ones, fused into the read: a Flatten of the documents themselves would send
        # the whole text through the runner once more (a second over a second on 100 MB).
        num_input_records = (
            (
                read.documents | "OnePerDocument" >> beam.Map(lambda _: 1),
                dropped_at_read | "OnePerDroppedRecord" >> beam.Map(lambda _: 1),
            )
            | "AllRecords" >> beam.Flatten()
            | "CountInputRecords" >> beam.CombineGlobally(sum)
        )
        created = read.documents | "CreatePretrainingInstances" >> CreatePretrainingInstances(
            config, self._vocab_bytes
        )
        shard_entries = created["instances"] | "WriteShards" >> WriteShards(
            config.output, self._vocab_size, config.shards_per_split(), config.rows_per_piece
        )
        reject_counts = (
            (read[REJECTS], created["rejects"])
            | "AllRejects" >> beam.Flatten()
            | "RejectTuples" >> beam.Map(tuple)
            | "RejectList" >> beam.combiners.ToList()
            | "WriteRejects" >> beam.Map(write_rejects_file, config.output)
        )
        return (
            pbegin
            | "Finish" >> beam.Create([None])
            | "WriteManifest"
            >> beam.ParDo(
                WriteManifest(config, self._vocab_bytes, self._vocab_size),
                beam.pvalue.AsList(shard_entries),
                AsSingleton(reject_counts),
                AsSingleton(created["document_stats"]),
                AsSingleton(num_input_records),
                beam.pvalue.AsList(read[FORMATS]),
            )
        )


def dataset_summary(data_dir: str, seconds: float) -> dict[str, Any]:
    if "://" in data_dir:
        result = manifest.Manifest.from_dict(
            json.loads(read_bytes(FileSystems.join(data_dir, manifest.MANIFEST_NAME)))
        )
    else:
        result = manifest.read_manifest(data_dir)
    formats = Counter(entry["format"] for entry in result.input_files.values())
    return {
        "output": data_dir,
        "seconds": round(seconds, 2),
        "input_formats": dict(sorted(formats.items())),
        **result.counts,
        "splits": {
            name: {
                "num_instances": s.num_instances,
                "num_documents": s.num_documents,
                "num_shards": len(s.shards),
                "num_empty_shards": sum(shard.num_rows == 0 for shard in s.shards),
            }
            for name, s in result.splits.items()
        },
    }


def build_pipeline(config: PrepareConfig, beam_args: Sequence[str] = ()) -> beam.Pipeline:
    """The whole job on a new pipeline, not run: `run` runs it, the Dataflow test translates it.

    `beam_args` are Beam's own flags (`--runner`, `--project`, `--direct_num_workers`, ...).
    """
    return _build(config, pipeline_options(beam_args))[0]


def pipeline_options(beam_args: Sequence[str]) -> PipelineOptions:
    """Beam's own flags, checked (`check_beam_args`), as Beam's options object."""
    check_beam_args(beam_args)
    return beam_options(beam_args)


def _build(config: PrepareConfig, options: PipelineOptions, start_over: bool = False
           ) -> tuple[beam.Pipeline, list]:
    """(the pipeline, the input files found)."""
    standard = options.view_as(StandardOptions)
    if not standard.runner:
        standard.runner = "DirectRunner"  # Beam's default (Prism) downloads a binary: fails offline
    unsupported = UNSUPPORTED_RUNNERS.get(standard.runner.split(".")[-1])
    if unsupported:
        raise ValueError(f"--runner {standard.runner}: {unsupported}")
    google = options.view_as(GoogleCloudOptions)
    check_gcs_paths([("--output", config.output), ("--temp_location", google.temp_location),
                     ("--staging_location", google.staging_location)]
                    + [("--input", split_format(pattern)[1]) for pattern in config.inputs])
    _check_dataflow(config, options)
    files = match_inputs(config.inputs, config.output, config.vocab)
    vocab_bytes = read_bytes(config.vocab)
    # A vocabulary that is no BERT one is refused before anything of the output is touched.
    vocab = parse_vocab(vocab_bytes, config.vocab)
    logger.info(
        "prepare: %d input files -> %s (runner %s)", len(files), config.output, standard.runner
    )
    if not options.view_as(TestOptions).dry_run:
        local_job.drop_a_finished_runs_leftovers(config.output)  # while its manifest says so
        stale = FileSystems.join(config.output, manifest.MANIFEST_NAME)
        if FileSystems.exists(stale):
            FileSystems.delete([stale])  # incomplete until this run's manifest lands
    _warn_on_casing_mismatch(vocab, config.lower_case)
    runner = None
    if _is_local(standard.runner):
        runner = local_job.local_runner(config, options, files, vocab_bytes, start_over)
    pipeline = beam.Pipeline(runner=runner, options=options)
    _without_beams_scratch_folder(pipeline)
    _ = pipeline | "PrepareDataset" >> PrepareDataset(config, files, vocab_bytes)
    return pipeline, files


def _without_beams_scratch_folder(pipeline: beam.Pipeline) -> None:
    """Beam's Pipeline makes a folder in the temporary directory (`local_tempdir`, for the
    artifacts of cross-language transforms: this job has none) that only `Pipeline.run` removes,
    at its end: a dry run, which is never run, and a run killed by SIGKILL or the OOM killer
    each left an empty `beam-pipeline-temp*` there. Removed at once; `run` ignores a missing one."""
    shutil.rmtree(pipeline.local_tempdir, ignore_errors=True)


def _check_dataflow(config: PrepareConfig, options: PipelineOptions) -> None:
    """A Dataflow job that would fail or lose its output (`dataflow_problems`) is refused
    before anything is sent; a dry run says what a real run would refuse, and goes on (its
    translation is checked offline, on local files)."""
    if not is_dataflow(options.view_as(StandardOptions).runner):
        return
    problems = dataflow_problems(config, options)
    if options.view_as(TestOptions).dry_run:
        for problem in problems:
            logger.warning("dry run: a real run is refused: %s", problem)
    elif problems:
        raise ValueError(f"--runner DataflowRunner: {'; '.join(problems)}")


def run(config: PrepareConfig, beam_args: Sequence[str] = (), wait: bool = True,
        start_over: bool = False) -> dict[str, Any]:
    """Run the job to completion; returns the manifest's counts and the Beam counters.

    With `--dry_run=True` nothing runs or is written: the report says what was checked. With
    `wait=False` (Dataflow) the job is left running and the report says how to follow it.
    A local run continues the work a killed run of the same job left in the output
    (`pipelines.local_job`); start_over discards it first.
    """
    return _run(config, pipeline_options(beam_args), wait, start_over)


def only_a_template(result) -> bool:
    """Dataflow with --template_location (what a template launcher may pass) writes the job's
    graph there and creates no job: nothing to watch or wait for, and no job id to name."""
    return getattr(result, "has_job", True) is False


def _summarised(error: Exception) -> str:
    """A runner's error in one line: Beam's message is a header ("Dataflow pipeline failed.
    State: FAILED, Error:") and the workers' traceback, whose last line says what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [repr(error)]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _dataflow_job_ended(submitted: dict[str, Any], error: BaseException) -> None:
    """Waiting on a Dataflow job ended: the job failed (one line with the first and last
    lines of Beam's error and where its log is), or this process was stopped, which leaves
    the job running (say so, and how to cancel it)."""
    if isinstance(error, Exception):
        raise ValueError(f"Dataflow job {submitted['job_id']} did not succeed: "
                         f"{_summarised(error)} (its log: {submitted['console']})") from error
    print(f"[prepare] the Dataflow job {submitted['job_id']} goes on without this process; "
          f"to stop it: {submitted['cancel']}", file=sys.stderr, flush=True)
    raise error


def _run(config: PrepareConfig, options: PipelineOptions, wait: bool, start_over: bool
         ) -> dict[str, Any]:
    start = time.monotonic()
    _warn_past_bert_positions(config.max_seq_length)
    earlier = local_job.files_before(config.output)  # before the job removes a manifest there
    pipeline, files = _build(config, options, start_over)
    options = pipeline.options
    runner = options.view_as(StandardOptions).runner
    if options.view_as(TestOptions).dry_run:
        refused = dataflow_problems(config, options) if is_dataflow(runner) else []
        return _dry_run(pipeline, runner, files, config.output, refused)
    submitted = None  # a Dataflow job's report, once one is created
    try:
        result = pipeline.run()
        if only_a_template(result):
            template = options.view_as(GoogleCloudOptions).template_location
            logger.info("prepare: wrote the job as a template to %s", template)
            return {"template": template, "output": config.output}
        if hasattr(result, "job_id"):  # Dataflow: where to watch it, before it runs for hours
            submitted = job_report.submitted_report(result.job_id(), options, config.output)
            logger.info("prepare: submitted Dataflow job %s: %s", submitted["job_id"],
                        submitted["console"])
            if not wait:
                return submitted
        result.wait_until_finish()
    except BaseException as error:
        if submitted is not None:
            _dataflow_job_ended(submitted, error)  # raises
        if not isinstance(error, Exception):
            raise
        local_job.after_failure(pipeline.runner, error, config.output, earlier)
        refusal = next((words for words in JOB_REFUSALS if words in str(error)), None)
        if refusal:
            # Beam wraps the DoFn's error (in another process with multi_processing): unwrap it.
            message = str(error)[str(error).index(refusal) :].split("\n")[0]
            message = message.split(" [while running")[0]
            raise ValueError(message) from error
        if not _is_local(runner):  # Flink, Spark, Prism: offline, its job server's download
            raise ValueError(f"--runner {runner}: the job did not succeed: "
                             f"{_summarised(error)}") from error
        raise
    local_job.after_success(pipeline.runner, config.output)
    summary = dataset_summary(config.output, time.monotonic() - start)
    _warn_on_thin_splits(summary["splits"], holds_out=config.validation_fraction > 0)
    summary["metrics"] = _counters(result)
    _warn_on_unknown_pieces(summary["metrics"], config.vocab)
    _warn_on_random_pairs(summary["metrics"], config.max_seq_length)
    if submitted is not None:
        summary["dataflow_job"] = submitted["console"]
    # The summary itself is the command's result (printed once, as JSON, by the caller).
    logger.info("prepare: done in %.1f s -> %s", summary["seconds"], config.output)
    return summary


def _dry_run(pipeline: beam.Pipeline, runner: str, files: list, output: str,
             refused: list[str]) -> dict[str, Any]:
    """Translate the job without running it (Dataflow: the job request, built and not sent)."""
    if is_dataflow(runner):
        proto = dataflow_job_request(pipeline)
    else:
        proto = pipeline.to_runner_api()
    report = job_report.dry_run_report(proto, runner, files, output)
    if refused:
        report["a_real_run_is_refused"] = refused
    logger.info("prepare: dry run (%s), nothing written", runner)
    return report


def dataflow_job_request(pipeline: beam.Pipeline) -> beam_runner_api_pb2.Pipeline:
    """The pipeline of the Dataflow job request that a DataflowRunner pipeline with
    `--dry_run=True` builds offline and does not send; nothing of it left in TMPDIR."""
    if not pipeline.options.view_as(TestOptions).dry_run:  # that run would submit the job
        raise ValueError("dataflow_job_request is for a pipeline with --dry_run=True")
    with _temporary_directory_of_our_own():
        return pipeline.run().job.proto_pipeline


@contextlib.contextmanager
def _temporary_directory_of_our_own() -> Iterator[None]:
    """Beam's Dataflow translation writes what a submission would stage into the temporary
    directory and never removes it: a `tmp*` folder (`pickled_main_session`,
    `submission_environment_dependencies.txt`: `environments.python_sdk_dependencies`), a
    `beam-requirements-cache` folder (the stager's) and, with PyPI requirements, a file. A dry
    run stages nothing, yet left them in TMPDIR at every run: within this block the temporary
    directory is a folder of ours, removed after. (Only a dry run: a real submission uploads
    those files from where Beam put them.)"""
    before = tempfile.tempdir
    scratch = tempfile.mkdtemp(prefix="bertforge-dry-run-")
    tempfile.tempdir = scratch
    try:
        yield
    finally:
        tempfile.tempdir = before
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The job's own command line (`python -m bertforge.pipelines.prepare`, the Flex Template's
    launcher): the job's flags and Beam's. `bertforge prepare` adds its dataset guard
    (`cluster.commands.guarded_prepare`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    return run_command(parse_command_line(argv))


def run_command(command: PrepareCommand, start_over: bool = False) -> dict[str, Any]:
    """A parsed command line run to its end (`run`); --quiet: the summary only."""
    with _warnings_only(command.quiet):  # Beam's flags were checked when it was parsed
        return _run(command.config, command.options, command.wait, start_over)


@contextlib.contextmanager
def _warnings_only(quiet: bool) -> Iterator[None]:
    ours = logging.getLogger("bertforge")
    level = ours.level
    if quiet:
        ours.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ours.setLevel(level)


def _counters(result: beam.runners.runner.PipelineResult) -> dict[str, int]:
    """The job's Beam counters ({} where a runner reports none)."""
    try:
        query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    except (NotImplementedError, AttributeError):
        return {}
    counters = sorted(query["counters"], key=lambda c: c.key.metric.name)
    return {
        c.key.metric.name: c.committed if c.committed is not None else c.attempted for c in counters
    }


# Runners Beam accepts whose results the job cannot rely on, and why.
UNSUPPORTED_RUNNERS = {
    "BundleBasedDirectRunner": "Beam's older local runner, which loses the job's per-file "
    "records (the manifest's input_files came out empty, or the manifest's step failed, on "
    "alternate runs); --runner DirectRunner is the local one",
}


def _is_local(runner: str) -> bool:
    """Beam's DirectRunner names our local runner (`pipelines.local_job`).

    Beam's DirectRunner first tries the Prism runner, which downloads a Go binary from GitHub:
    offline that fails (after a DNS lookup) and falls back to the FnApiRunner, online it silently
    runs elsewhere. Naming the FnApiRunner (ours derives from it) keeps local runs the same on
    every machine; it honours --direct_num_workers and --direct_running_mode as the DirectRunner
    does.
    """
    return runner.split(".")[-1] in ("DirectRunner", "direct")


# The positions of every BERT preset and of Google's and Hugging Face's BERT checkpoints
# (training.model.BertConfig.max_position_embeddings; pipelines do not import training).
BERT_POSITIONS = 512


def _warn_past_bert_positions(max_seq_length: int) -> None:
    """A length train refuses unless the model is made for it: said before the job runs,
    not after hours of it, when `train` refuses the dataset."""
    if max_seq_length > BERT_POSITIONS:
        logger.warning(
            "--max-seq-length %d is past the %d positions of BERT's presets and published "
            "checkpoints: training on this dataset needs a model with max_position_embeddings "
            ">= %d, which no preset has (a BertConfig field of the model's)", max_seq_length,
            BERT_POSITIONS, max_seq_length)


def _warn_on_thin_splits(splits: dict[str, dict[str, int]], holds_out: bool = True) -> None:
    """Data that trains without a word but cannot teach what it should: a dataset of one book
    trained NSP on a constant label (its loss fell to 0.22), and its empty validation split was
    only found by `--eval-every` or `eval` (`holds_out`: unless none was asked for)."""
    train = splits.get("train", {})
    if train.get("num_documents", 0) == 1:
        logger.warning(
            "the training split holds 1 document: next-sentence prediction draws its random "
            "second segment from another document, so every pair here is a real next and NSP "
            "learns a constant label; add documents (each article, book or record is one)")
    if (holds_out and train.get("num_instances")
            and not splits.get("validation", {}).get("num_instances")):
        logger.warning(
            "the validation split is empty (it holds out whole documents): --eval-every and "
            "`bertforge eval` will have nothing to score; add documents")
    # More shards asked for than a split has instances: the rest are written empty (an empty
    # split has its own warning above).
    flags = {"train": "--num-shards", "validation": "--num-validation-shards"}
    for name, split in splits.items():
        if split.get("num_instances") and split.get("num_empty_shards"):
            logger.warning(
                "%d of the %s split's %d shards are empty: it has %d instances; %s sets how "
                "many shards", split["num_empty_shards"], name, split["num_shards"],
                split["num_instances"], flags.get(name, "--num-shards"))


# A share of [UNK] pieces past which the vocabulary does not fit the text: Google's uncased
# vocabulary left 4 of 267,825 pieces unknown in ../shared/data's Wikipedia excerpt and Emma
# (0.0015 %); a vocabulary of 7 entries left 92 % of two books.
UNKNOWN_SHARE_WARNED = 0.05


def _warn_on_unknown_pieces(metrics: dict[str, int], vocab: str) -> None:
    """A vocabulary that does not fit the corpus (another language or script, a vocabulary of
    other text) made a dataset of [UNK]s that trained without a word: 97 % of its tokens."""
    tokenized, unknown = metrics.get(TOKENIZED_PIECES, 0), metrics.get(UNKNOWN_PIECES, 0)
    if tokenized and unknown / tokenized > UNKNOWN_SHARE_WARNED:
        logger.warning(
            "%.1f %% of the corpus's word pieces are [UNK]: the vocabulary %s does not fit this "
            "text (another language or script, or a vocabulary made from other text); "
            "`bertforge vocab` trains one on this corpus", 100 * unknown / tokenized, vocab)


# Google's pairing draws a random second segment for half the pairs, and for every pair whose
# chunk holds one sentence (it has no real next to split off). Wikipedia and two books gave 59 %
# at 128 tokens (../shared/data, long sentences); at 32 tokens and less, 73-100 %.
RANDOM_SHARE_WARNED = 0.7


def _warn_on_random_pairs(metrics: dict[str, int], max_seq_length: int) -> None:
    """Sequences too short for two sentences made NSP labels that were nearly all "random"
    without a word (`inspect` showed it): next-sentence prediction then learns little."""
    instances, random_next = metrics.get(INSTANCES, 0), metrics.get(RANDOM_NEXT, 0)
    if instances and random_next / instances > RANDOM_SHARE_WARNED:
        logger.warning(
            "%.0f %% of the sentence pairs have a random next sentence (half would be the "
            "design): at --max-seq-length %d most sentences fill a sequence alone, leaving no "
            "real next to pair them with, so next-sentence prediction learns little; BERT "
            "prepares 128 (phase 1) and 512 (phase 2)", 100 * random_next / instances,
            max_seq_length)


def _warn_on_casing_mismatch(vocab: dict[str, int], lower_case: bool) -> None:
    """An uncased vocab with --no-lower-case (or the reverse) silently maps words to [UNK].
    Each message names the setting as `prepare` and as a pipeline file spell it (the
    pipeline's prepares take `[vocab] lower_case`)."""
    num_upper = sum(token[:1].isupper() for token in vocab if not token.startswith("["))
    if lower_case and num_upper > 0.05 * len(vocab):
        logger.warning(
            "lower-casing is on (prepare's default; a pipeline file's [vocab] lower_case), but "
            "%d vocabulary entries are capitalized: a cased vocab? If so, prepare with "
            "--no-lower-case ([vocab] lower_case = false)",
            num_upper,
        )
    # ASCII capitals only: Google's uncased vocab keeps a few capitals of other scripts ("ℝ"),
    # and a cased one starts thousands of entries with A-Z.
    if not lower_case and not any("A" <= token.lstrip("#")[:1] <= "Z" for token in vocab
                                  if not token.startswith("[")):
        logger.warning(
            "lower-casing is off (--no-lower-case; a pipeline file's [vocab] lower_case = "
            "false), but no vocabulary entry starts with a capital A-Z: an uncased vocab? If "
            "so, capitalized words become [UNK] or pieces: leave lower-casing on (without "
            "--no-lower-case; [vocab] lower_case = true)"
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(json.dumps(main(), indent=2, ensure_ascii=False))
