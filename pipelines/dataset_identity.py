"""What a dataset was made from, and how a requested job differs from it.

Two `prepare` runs make the same dataset when they read the same input files with the same
vocabulary and instance parameters (`PrepareConfig.instance_params`: seed, lengths, shards,
...). How the job runs (runner, workers, `rows_per_piece`) changes no byte and is not compared.
The manifest already records all three, so a directory made by any bertforge can be compared.
"""

from __future__ import annotations

from bertforge.pipelines.contract.manifest import Manifest
from bertforge.pipelines.prepare_options import PrepareConfig

MAX_NAMED = 3  # input files named in a difference, then a count


def dataset_differences(found: Manifest, config: PrepareConfig, input_paths: list[str],
                        vocab_sha256: str, input_sizes: dict[str, int] | None = None,
                        gone_is_a_difference: bool = True) -> list[str]:
    """What differs between the dataset `found` and the one `config` would make, one phrase
    per difference ([] when they are the same dataset). An input whose size is not the one
    the manifest recorded has changed since (`input_sizes`: the files' sizes now). Without
    `gone_is_a_difference`, inputs the manifest names that are not among `input_paths` any
    more are not reported (deleted since: the dataset is all that is left of them)."""
    differences = []
    wanted = config.instance_params()
    for key in sorted(set(wanted) | set(found.instance_params)):
        if found.instance_params.get(key) != wanted.get(key):
            differences.append(f"{key} {found.instance_params.get(key)!r} -> "
                               f"{wanted.get(key)!r}")
    if found.tokenizer.vocab_sha256 != vocab_sha256:
        differences.append("the vocabulary (another sha256)")
    before, now = set(found.input_files), set(input_paths)
    gone = before - now if gone_is_a_difference else set()
    if gone or now - before:
        differences.append("the input files (" + "; ".join(filter(None, (
            _named("no longer", gone), _named("new", now - before)))) + ")")
    sizes = input_sizes or {}
    changed = {path for path in before & now
               if found.input_files[path].get("bytes") not in (None, sizes.get(path))}
    if changed:
        differences.append(f"the input files' content ({_named('another size', changed)})")
    return differences


def _named(what: str, paths: set[str]) -> str:
    if not paths:
        return ""
    listed = sorted(paths)
    more = f" and {len(listed) - MAX_NAMED} more" if len(listed) > MAX_NAMED else ""
    return f"{what}: {', '.join(listed[:MAX_NAMED])}{more}"
