"""What a dataset was made from, and how a requested job differs from it.

Two `prepare` runs make the same dataset when they read the same input files with the same
vocabulary and instance parameters (`PrepareConfig.instance_params`: seed, lengths, shards,
...). How the job runs (runner, workers, `rows_per_piece`) changes no byte and is not compared.
The manifest already records all three, so a directory made by any bertforge can be compared.
"""

from __future__ import annotations

import os

from bertforge.pipelines.contract.manifest import Manifest
from bertforge.pipelines.prepare_options import PrepareConfig
from bertforge.pipelines.read.readers import input_location, lies_within

MAX_NAMED = 3  # input files named in a difference, then a count
# The manifest's `extra` key of the directory a local prepare ran in (its relative inputs').
WORKING_DIRECTORY = "working_directory"


def dataset_differences(found: Manifest, config: PrepareConfig, input_paths: list[str],
                        vocab_sha256: str, input_sizes: dict[str, int] | None = None,
                        gone_is_a_difference: bool = True,
                        moved: tuple[str, str] | None = None,
                        forced_formats: dict[str, str | None] | None = None) -> list[str]:
    """What differs between the dataset `found` and the one `config` would make, one phrase
    per difference ([] when they are the same dataset). An input whose size is not the one
    the manifest recorded has changed since (`input_sizes`: the files' sizes now). Without
    `gone_is_a_difference`, inputs the manifest names that are not among `input_paths` any
    more are not reported (deleted since: the dataset is all that is left of them). `moved`:
    (from, to), a folder moved whole with its inputs since (a pipeline's project folder): the
    recorded inputs under `from` are looked for under `to`. `forced_formats`: the FORMAT:
    prefix each of `input_paths` is named with now (None: none), compared with the format the
    manifest says each file was read as."""
    differences = []
    wanted = config.instance_params()
    for key in sorted(set(wanted) | set(found.instance_params)):
        if found.instance_params.get(key) != wanted.get(key):
            differences.append(f"{key} {found.instance_params.get(key)!r} -> "
                               f"{wanted.get(key)!r}")
    if found.tokenizer.vocab_sha256 != vocab_sha256:
        differences.append("the vocabulary (another sha256)")
    # By where the files are, not how they were spelled: a relative path is resolved in the
    # working directory of the run that wrote it (recorded since 2026-11-28; before, this one).
    recorded_in = found.extra.get(WORKING_DIRECTORY) or os.getcwd()
    before = {moved_location(input_location(path, recorded_in), moved): path
              for path in found.input_files}
    now = {input_location(path): path for path in input_paths}
    gone = {before[key] for key in before.keys() - now.keys()} if gone_is_a_difference else set()
    new = {now[key] for key in now.keys() - before.keys()}
    if gone or new:
        differences.append("the input files (" + "; ".join(filter(None, (
            _named("no longer", gone), _named("new", new)))) + ")")
    sizes = input_sizes or {}
    changed = {now[key] for key in before.keys() & now.keys()
               if found.input_files[before[key]].get("bytes") not in (None, sizes.get(now[key]))}
    if changed:
        differences.append(f"the input files' content ({_named('another size', changed)})")
    if forced_formats is not None:
        read_otherwise = [
            f"{now[key]} as {found.input_files[before[key]]['format']} -> {fmt}"
            for key in sorted(before.keys() & now.keys())
            if (fmt := _format_now(found.input_files[before[key]], now[key],
                                   forced_formats.get(now[key]))) is not None]
        if read_otherwise:
            differences.append("how the input files are read (" + "; ".join(
                read_otherwise[:MAX_NAMED]) + (f" and {len(read_otherwise) - MAX_NAMED} more"
                                               if len(read_otherwise) > MAX_NAMED else "") + ")")
    return differences


def _format_now(recorded: dict, path: str, forced: str | None) -> str | None:
    """The format `path` would be read as now, where it is not the one `recorded` in the
    manifest; else None. The same bytes read as books (paragraphs) or as a sentence a line
    make other documents: a `books:` prefix added after prepare's warning made the same job
    again, and it was taken for the finished dataset ("nothing to do")."""
    was = recorded.get("format")
    if was is None:  # a manifest that does not say
        return None
    if forced:
        return forced if forced != was else None
    if recorded.get("chosen_by") != "prefix":
        return None  # chosen by name or content then as now, of a file of the same size
    # The prefix is gone: the file's name or its first bytes choose now.
    from bertforge.pipelines.filesystem import open_raw
    from bertforge.pipelines.read.input_files import detect_format

    try:
        choice = detect_format(path, None, open_raw)
    except (OSError, ValueError):
        return None  # unreadable now: the job's own walk says so
    fmt = "not read" if choice.mismatch else choice.fmt
    return fmt if fmt != was else None


def moved_location(location: str, moved: tuple[str, str] | None) -> str:
    """`location` with the folder `moved[0]` it lies in replaced by `moved[1]`."""
    if moved is None:
        return location
    old, new = (os.path.realpath(folder) for folder in moved)
    if lies_within(location, old):
        # Resolved again where it is now: a link inside the folder (a corpus kept elsewhere)
        # could not be followed where the folder was.
        return os.path.realpath(os.path.join(new, os.path.relpath(location, old)))
    return location


def _named(what: str, paths: set[str]) -> str:
    if not paths:
        return ""
    listed = sorted(paths)
    more = f" and {len(listed) - MAX_NAMED} more" if len(listed) > MAX_NAMED else ""
    return f"{what}: {', '.join(listed[:MAX_NAMED])}{more}"
