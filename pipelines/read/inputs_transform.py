"""Input patterns -> files -> (in parallel) raw documents and read rejects.

Each file is one element, so files are read in parallel. A Wikipedia `-multistream` dump whose
`-index.txt.bz2` sits beside it is further cut into byte ranges on bz2 stream boundaries
(`wiki_xml.plan_ranges`): a 20 GB dump becomes ~300 parallel reads instead of one.
"""

from __future__ import annotations

import bz2
import glob
import json
import logging
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import TaggedOutput

from bertforge.pipelines.beam_common import LOG_EVERY_DOCUMENTS, REJECTS, count, reject_output
from bertforge.pipelines.contract.manifest import MANIFEST_NAME, VOCAB_NAME, is_bertforge_dataset
from bertforge.pipelines.filesystem import open_raw
from bertforge.pipelines.log_only import LOG_ONLY
from bertforge.pipelines.read import readers, wiki_xml
from bertforge.pipelines.read.input_files import detect_format, format_mismatch, read_file
from bertforge.pipelines.read.records import Reject

logger = logging.getLogger(__name__)


def _silent(*args) -> None:
    """A walk's `say` where another walk of the same inputs says it (the dataset guard's)."""


FORMATS = "formats"  # the tag of ReadFile's (path, format, chosen_by) per input file
NOT_READ = "not read"  # the format of an input refused whole (format_mismatch)


class InputFile(NamedTuple):
    path: str
    doc_id_prefix: str
    forced: str | None  # a format prefix (`wiki:...`), or None: name, else content, decides
    byte_range: tuple[int, int] | None = None  # None: the whole file


def input_patterns(entries) -> tuple[str, ...]:
    """`--input` as given (repeated, or comma-separated lists) -> one pattern each.

    A FORMAT: prefix at the head of a list is the list's (`books:a.txt,b.txt` is two books;
    it was one book and one plain-text file); a part with a prefix of its own keeps it. A `~`
    the shell left (after a prefix or a comma) is the home directory, as at a word's start."""
    patterns = []
    for entry in entries:
        forced = None
        _, whole = readers.split_format(entry.strip())
        # A file whose name holds a comma (`part,1.jsonl`) is that file.
        parts = [entry] if os.path.exists(os.path.expanduser(whole)) else entry.split(",")
        for part in (p.strip() for p in parts):
            if not part:
                continue
            prefix, path = readers.split_format(part)
            if forced is None:
                forced = prefix or ""
            prefix = prefix or forced
            path = os.path.expanduser(path)
            patterns.append(f"{prefix}:{path}" if prefix else path)
    return tuple(patterns)


def match_inputs(patterns: tuple[str, ...], output: str | None = None,
                 vocab: str | None = None, *, quiet: bool = False
                 ) -> list[tuple[str, str | None]]:
    """(file, forced format or None) of every file the patterns match, sorted; a clear error
    for a bad pattern. The format itself is chosen where the file is read (`detect_format`).

    A local directory stands for every file under it (`files_under`). Multistream index files
    are not corpus: skipped. Nor is anything under `output`, the job's own directory (a
    dataset made into `corpus/shards` from `corpus/`): its shards, manifest and log would be
    read as text by the next run, and that run's changed inputs refused as another dataset.
    Nor is `vocab`, prepare's vocabulary, where it lies among the corpus files. What is left
    out is said in the log, unless `quiet` (a walk that only compares, before the job's own).
    """
    say = _silent if quiet else logger.info
    files: dict[str, str | None] = {}
    named: dict[str, str] = {}  # a file's location -> the path it was first named by
    forced_by: dict[str, tuple[str, str]] = {}  # a file's location -> (its prefix, the entry)
    inside_output = _inside(output) if output else (lambda path: False)
    for entry in patterns:
        forced, pattern = readers.split_format(entry)
        if _reachable_folder(entry, pattern):
            matched = files_under(pattern, say)
            _refuse_dangling_links(entry, matched)
        elif "://" not in pattern and os.path.isfile(pattern):
            matched = [pattern]  # a name with glob characters (`data[1].jsonl`) is that file
        else:
            try:
                metadata = FileSystems.match([pattern])[0].metadata_list
            except Exception as error:  # BeamIOError or IOError, by the filesystem
                raise ValueError(f"--input {entry!r}: cannot list it ({error})") from error
            matched = [m.path for m in metadata if not _is_directory(m.path)]
            if "://" not in pattern:
                _refuse_dangling_links(entry, sorted(glob.glob(pattern)))
        if not matched:
            _refuse_unreadable_folder(entry, pattern)
            hidden = _is_directory(pattern) and any(
                name.startswith(".") and os.path.isdir(os.path.join(pattern, name))
                for name in os.listdir(pattern))
            workdir = _is_directory(pattern) and is_run_workdir(pattern, os.listdir(pattern))
            raise ValueError(f"--input {entry!r} matches no file" + (
                " (its hidden folders, such as .git, are never read as corpus: name their "
                "files, e.g. DIR/.folder/*.txt)" if hidden else "") + (
                f" outside a bertforge {workdir}'s workdir (what it writes is never read as "
                "corpus): keep the corpus and the workdir apart" if workdir else "")
                + _unknown_prefix(entry))
        ours = [path for path in matched if inside_output(path)]
        if ours:
            matched = [path for path in matched if not inside_output(path)]
            if not matched:
                raise ValueError(f"--input {entry!r} matches no file outside --output {output} "
                                 "(the output directory is never read as corpus): keep the "
                                 "corpus and the output apart")
            say("leaving out %d file(s) under --output %s: the job's own, not corpus",
                len(ours), output)
        _refuse_unreadable_files(entry, matched)
        for path in matched:
            if vocab and readers.input_location(path) == readers.input_location(vocab):
                say("leaving out %s: the --vocab, not corpus", path)
                continue
            if wiki_xml.is_multistream_index(path):
                say("skipping %s: a multistream index, used to split its dump", path)
                continue
            # The same file named twice (`corpus/a.txt`, `./corpus/a.txt`) is read once, as the
            # later naming says (`corpus`, then `books:corpus/a.txt`); two formats forced on
            # it (`books:`, then `sentences:`) contradict each other: the last won unsaid.
            location = readers.input_location(path)
            _refuse_two_formats(named.get(location, path), forced_by.get(location),
                                (forced, entry))
            if forced:
                forced_by[location] = (forced, entry)
            files[named.setdefault(location, path)] = forced
    if not files:
        raise ValueError(f"--input {list(patterns)} matches no corpus file")
    return sorted(files.items())


def _reachable_folder(entry: str, pattern: str) -> bool:
    """Whether `pattern` is a folder; object storage out of reach (no credentials, no network,
    a client not installed) is one line naming the entry, where it was Beam's traceback (123
    lines for gs:// after 99 s of the client's retries)."""
    try:
        return FileSystems.exists(pattern) and _is_directory(pattern)
    except Exception as error:  # BeamIOError, the cloud clients' own
        if "://" not in pattern:
            raise
        cause = next(iter(getattr(error, "exception_details", {}).values()), error)
        said = str(cause).splitlines()[0][:300] if str(cause) else ""
        raise ValueError(f"--input {entry!r}: cannot reach it ({type(cause).__name__}: {said}); "
                         "check the path, the credentials and the network") from error


def _refuse_two_formats(path: str, before: tuple[str, str] | None,
                        now: tuple[str | None, str]) -> None:
    """A file named with two `FORMAT:` prefixes, (format, entry) each, is an error naming
    both: which one it is, only its owner knows."""
    if before and now[0] and before[0] != now[0]:
        raise ValueError(f"{path} is named as {before[0]} ({before[1]!r}) and as {now[0]} "
                         f"({now[1]!r}): give it one format")


def _unknown_prefix(entry: str) -> str:
    """What to say of an entry that matched nothing and starts with a word and a colon that no
    format is named (`book:corpus/*.txt`): the words that are."""
    name, colon, rest = entry.partition(":")
    if not colon or not name.isalpha() or rest.startswith("//") or len(name) == 1:
        return ""  # no prefix (a URI's scheme, a Windows drive)
    if name in readers.FORMATS:
        return ""  # a format's own prefix: the path after it matches nothing
    return f" ('{name}:' is no format; the formats are {', '.join(sorted(readers.FORMATS))})"


def _inside(directory: str):
    """A test of whether a path lies in `directory` (or is it): by the real local paths, so
    `./out`, `out/` and an absolute spelling are one, or by the URL's prefix (gs://...)."""
    if "://" in directory:
        prefix = directory.rstrip("/") + "/"
        return lambda path: path == prefix[:-1] or path.startswith(prefix)
    root = os.path.realpath(directory)
    return lambda path: "://" not in path and os.path.commonpath(
        [root, os.path.realpath(path)]) == root


def files_under(directory: str, say: Callable[..., None] = logger.info) -> list[str]:
    """Every file under a local directory, in its subdirectories too (WikiExtractor writes
    `AA/wiki_00`, `AB/wiki_00`, ...), sorted; hidden subdirectories (`.git`, `.cache`) are left
    out, hidden files kept. Symbolic links to directories are not followed.

    bertforge's own outputs there are no corpus and are left out too: a dataset (a folder with
    bertforge's manifest.json, whose shards, vocabulary and logs were read as text), a
    pipeline's (or demo's) workdir, the directory itself included (`is_run_workdir`), a
    pipeline file (`is_pipeline_file`), a `vocab` output's vocab.txt, and the commands' logs
    (`logs/prepare.log`, ...)."""
    found = []

    def unreadable(error: OSError) -> None:  # os.walk passed over it without a word
        raise ValueError(f"--input {directory}: cannot read its folder {error.filename} "
                         f"({error.strerror}); its files would be left out")

    for folder, subfolders, names in os.walk(directory, onerror=unreadable):
        if folder != directory and _is_dataset(folder, names):
            subfolders[:] = []
            say("leaving out %s: a bertforge dataset, not corpus", folder)
            continue
        if is_run_workdir(folder, names):
            # Its state file, lock, runs and export were read as corpus, and every later run
            # was refused: they were "new input files" (and the state file "of another size").
            subfolders[:] = []
            say("leaving out %s: a bertforge %s's workdir (its own files), not corpus",
                folder, is_run_workdir(folder, names))
            continue
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        for linked in (d for d in subfolders if os.path.islink(os.path.join(folder, d))):
            say("leaving out %s: a symbolic link to a folder, not followed (give it as an "
                "--input of its own to read it)", os.path.join(folder, linked))
        ours = _our_files(folder, names)
        for name in sorted(name for name in names if is_pipeline_file(folder, name)):
            # `inputs = ["."]` beside it: read as text, and each edit of the file (a cadence
            # key) refused as an input "of another size".
            say("leaving out %s: a bertforge pipeline file, not corpus",
                os.path.join(folder, name))
            ours.add(name)
        found += [os.path.join(folder, name) for name in names if name not in ours]
    return sorted(found)


# The log files bertforge's commands write into an output's or a run's `logs/` folder.
_OUR_LOG = re.compile(r"(prepare|vocab|train|eval|export|finetune|glue|pipeline|demo"
                      r"|worker-\d+)\.log")


def _is_dataset(folder: str, names: list[str]) -> bool:
    return MANIFEST_NAME in names and is_bertforge_dataset(folder)


# The state file a stage-running command keeps in its directory (`cluster.commands.
# stage_runner`: COMMAND.json, with the job's "settings" and finished "stages").
_RUN_STATE = re.compile(r"(pipeline|demo|finetune|glue)\.json")


def is_run_workdir(folder: str, names: list[str]) -> str:
    """The command ("pipeline", "demo", ...) whose workdir `folder` is, by its state file;
    "" for any other folder (a corpus file named pipeline.json is no state: read as corpus)."""
    for name in names:
        if _RUN_STATE.fullmatch(name):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    state = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(state, dict) and {"settings", "stages"} <= state.keys():
                return name.removesuffix(".json")
    return ""


def _our_files(folder: str, names: list[str]) -> set[str]:
    """The names in `folder` that a bertforge command wrote: a `vocab` output's vocab.txt
    (beside its logs/vocab.log), and the commands' logs."""
    if os.path.basename(folder) == "logs":
        return {name for name in names if _OUR_LOG.fullmatch(name)}
    if VOCAB_NAME in names and os.path.isfile(os.path.join(folder, "logs", "vocab.log")):
        return {VOCAB_NAME}
    return set()


def is_pipeline_file(folder: str, name: str) -> bool:
    """Whether `name` in `folder` is a `bertforge pipeline` file: TOML with a `workdir` and a
    [phase1] table."""
    if not name.endswith(".toml"):
        return False
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 (pyproject.toml installs tomli there)
        import tomli as tomllib
    try:
        with open(os.path.join(folder, name), "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError):
        return False
    return "workdir" in data and isinstance(data.get("phase1"), dict)


def _refuse_unreadable_files(entry: str, matches: list[str]) -> None:
    """A local file this process may not read is an error naming it, before the job: read by
    a Beam worker it failed the job with a traceback, again on every rerun."""
    unreadable = [p for p in matches if "://" not in p and not os.access(p, os.R_OK)]
    if unreadable:
        raise ValueError(f"--input {entry!r}: cannot read {unreadable[0]} (permission denied)"
                         + (f", nor {len(unreadable) - 1} more" if len(unreadable) > 1 else ""))


def _refuse_unreadable_folder(entry: str, pattern: str) -> None:
    """A glob into a folder this process may not list matched nothing, and said only that."""
    if "://" in pattern:
        return
    folder = os.path.dirname(pattern)
    while folder and glob.has_magic(folder):
        folder = os.path.dirname(folder)
    if folder and os.path.isdir(folder) and not os.access(folder, os.R_OK | os.X_OK):
        raise ValueError(f"--input {entry!r}: cannot read its folder {folder} (permission "
                         "denied)")


def _refuse_dangling_links(entry: str, matches: list[str]) -> None:
    """A local symbolic link whose target is gone is an error naming it: Beam's match skips it
    without a word, and a corpus would silently lose a file."""
    dangling = [p for p in matches if os.path.islink(p) and not os.path.exists(p)]
    if dangling:
        raise ValueError(f"--input {entry!r}: {dangling[0]} is a symbolic link to a missing file "
                         f"({os.readlink(dangling[0])})"
                         + (f", and {len(dangling) - 1} more" if len(dangling) > 1 else ""))


def _is_directory(path: str) -> bool:
    return "://" not in path and os.path.isdir(path)


def input_files(files: list[tuple[str, str | None]]) -> list[InputFile]:
    prefixes = readers.doc_id_prefixes(path for path, _ in files)
    return [InputFile(path, prefixes[path], forced) for path, forced in files]


def split_multistream(item: tuple):
    """A multistream dump with its index -> byte ranges; any other file -> itself.

    Multistream dumps are named so (Wikimedia's names), so the name alone decides here.
    """
    item = InputFile(*item)
    is_wiki = readers.format_of(item.path, item.forced) == "wiki"
    index = wiki_xml.multistream_index_path(item.path) if is_wiki else None
    if index is None or not FileSystems.exists(index):
        yield item
        return
    with open_raw(index) as raw, bz2.BZ2File(raw) as lines:
        offsets = wiki_xml.stream_offsets(iter(lines.readline, b""))
    size = FileSystems.match([item.path])[0].metadata_list[0].size_in_bytes
    ranges = wiki_xml.plan_ranges(offsets, size, wiki_xml.RANGE_BYTES)
    logger.info("%s: %d streams -> %d parallel ranges", item.path, len(offsets), len(ranges))
    for byte_range in ranges:
        yield item._replace(byte_range=byte_range)


class ReadFile(beam.DoFn):
    """An input file (or byte range) -> raw documents, and rejects for what could not be used."""

    def process(self, item: InputFile):
        where = item.path if item.byte_range is None else f"{item.path}{list(item.byte_range)}"
        # A byte range is sniffed at the file's start (its header stream): every range of a file
        # gets the same format, and the first range alone reports it.
        choice = detect_format(item.path, item.forced, open_raw)
        if choice.mismatch:
            logger.error("input %s: %s", item.path, choice.mismatch)
            count("input_files")
            if not item.byte_range or item.byte_range[0] == 0:
                yield reject_output(format_mismatch(item.path, choice))
                # Listed among the inputs all the same: the manifest names every input, and
                # the same job again finds the same files (it was refused: "new: ...").
                yield TaggedOutput(FORMATS, (item.path, NOT_READ, "format_mismatch"))
            return
        if not item.byte_range or item.byte_range[0] == 0:
            logger.info("input %s: format %s (by %s)", item.path, choice.fmt, choice.chosen_by,
                        extra=LOG_ONLY)
            if choice.doubt:
                logger.warning("input %s: read as a sentence a line, but %s Name it "
                               "books:%s to read it as paragraphs", item.path, choice.doubt,
                               item.path)
            yield TaggedOutput(FORMATS, (item.path, choice.fmt, choice.chosen_by))
        num_documents = num_rejects = 0
        for record in read_file(
            item.path, item.doc_id_prefix, choice.fmt, open_raw, item.byte_range
        ):
            if isinstance(record, Reject):
                num_rejects += 1
                yield reject_output(record)
                continue
            num_documents += 1
            if num_documents % LOG_EVERY_DOCUMENTS == 0:
                logger.debug("read %s: %d documents so far", where, num_documents)
            yield record
        count("input_files")
        count("input_documents", num_documents)
        count("input_bytes", _num_bytes(item))
        logger.info("read %s (%s): %d documents, %d rejects", where, choice.fmt, num_documents,
                    num_rejects, extra=LOG_ONLY)


def _num_bytes(item: InputFile) -> int:
    """Bytes of the file (or byte range) read, as stored: progress counts MB read by it."""
    if item.byte_range is not None:
        return item.byte_range[1] - item.byte_range[0]
    return FileSystems.match([item.path])[0].metadata_list[0].size_in_bytes


class ReadInputs(beam.PTransform):
    """[(path, forced format)] -> {"documents": RawDocument, REJECTS: Reject,
    FORMATS: (path, format, chosen_by) per file read}."""

    def __init__(self, files: list[tuple[str, str | None]]):
        super().__init__()
        self._files = files

    def expand(self, pbegin):
        return (
            pbegin
            # Plain tuples: Beam would infer a schema (RowCoder) for a NamedTuple element type.
            | "ListFiles" >> beam.Create([tuple(f) for f in input_files(self._files)])
            | "SpreadFiles" >> beam.Reshuffle()
            | "SplitMultistream" >> beam.FlatMap(split_multistream)
            | "SpreadRanges" >> beam.Reshuffle()
            | "ReadFiles"
            >> beam.ParDo(ReadFile()).with_outputs(REJECTS, FORMATS, main="documents")
        )
