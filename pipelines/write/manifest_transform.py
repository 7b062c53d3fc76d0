"""The job's last steps: rejects.jsonl, then vocab.txt and manifest.json (written last)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from bertforge.pipelines.beam_common import NO_DOCUMENTS_MESSAGE, NO_INSTANCES_MESSAGE
from bertforge.pipelines.contract import manifest
from bertforge.pipelines.dataset_identity import WORKING_DIRECTORY
from bertforge.pipelines.filesystem import sizes_of, write_bytes
from bertforge.pipelines.log_only import LOG_ONLY
from bertforge.pipelines.prepare_options import PrepareConfig
from bertforge.pipelines.read.records import REPAIRED_REASONS, Reject

logger = logging.getLogger(__name__)


def write_rejects_file(rejects: list, output: str) -> dict[str, dict[str, int]]:
    """Write every reject, sorted, one JSON object per line.

    Returns {"rejected": {reason: n}, "repaired": {reason: n}}: repaired records were kept.
    """
    rejects = sorted(rejects)
    lines = "".join(Reject(*r).to_json() + "\n" for r in rejects)
    write_bytes(FileSystems.join(output, manifest.REJECTS_NAME), lines.encode("utf-8"))
    counts = Counter(r[0] for r in rejects)
    # Said by WriteManifest once the dataset lands: a job with no document removes this file.
    return {
        "rejected": {r: n for r, n in sorted(counts.items()) if r not in REPAIRED_REASONS},
        "repaired": {r: n for r, n in sorted(counts.items()) if r in REPAIRED_REASONS},
    }


class WriteManifest(beam.DoFn):
    """Copies vocab.txt, then writes manifest.json.

    Every other output is a side input of this step, so it runs last.
    """

    def __init__(self, config: PrepareConfig, vocab_bytes: bytes, vocab_size: int):
        self._config = config
        self._vocab_bytes = vocab_bytes
        self._vocab_size = vocab_size
        # The command's, taken where the job is built: workers (Dataflow's) run elsewhere.
        self._working_directory = os.getcwd()

    def process(
        self, _, shard_entries, reject_counts, document_stats, num_input_records, input_formats=()
    ):
        num_documents = sum(stats[0] for stats in document_stats.values())
        if num_documents == 0:
            raise ValueError(
                f"{NO_DOCUMENTS_MESSAGE}: {num_input_records} input records read from "
                f"{list(self._config.inputs)}, rejected: {reject_counts['rejected'] or 'none'}"
            )
        train_instances = sum(e["num_rows"] for e in shard_entries if e["split"] == "train")
        if train_instances == 0:  # a dataset nothing can train on, which exited 0
            raise ValueError(
                f"{NO_INSTANCES_MESSAGE}: the {num_documents:,} document(s) kept gave no "
                "sentence pair for the training split (a pair needs a document's text split "
                "into sentences: text without sentence ends, or a line ending where a "
                "paragraph does not, is one long 'sentence'; --input books:FILE reads "
                "paragraphs)")
        output = self._config.output
        num_rejects = {**reject_counts["rejected"], **reject_counts["repaired"]}
        logger.info("wrote %s: %d entries %s", manifest.REJECTS_NAME, sum(num_rejects.values()),
                    num_rejects, extra=LOG_ONLY)
        write_bytes(FileSystems.join(output, manifest.VOCAB_NAME), self._vocab_bytes)
        result = build_manifest(
            self._config,
            self._vocab_bytes,
            self._vocab_size,
            shard_entries,
            reject_counts,
            document_stats,
            num_input_records,
            input_formats,
            working_directory=self._working_directory,
        )
        if "://" in output:
            write_bytes(
                FileSystems.join(output, manifest.MANIFEST_NAME), result.to_json().encode("utf-8")
            )
        else:
            remove_unlisted_shards(output, result)
            manifest.write_manifest(output, result)
        logger.info("wrote %s", FileSystems.join(output, manifest.MANIFEST_NAME))
        yield result.counts


def remove_unlisted_shards(output: str, result: manifest.Manifest) -> None:
    """The shards of the dataset this one replaces (`--overwrite` with another --num-shards)
    go before the manifest that marks this one complete. Removed after it (by `local_job`, once
    the job ended), a kill between the two left a complete-looking dataset holding them:
    `inspect --verify` failed on each, and a reader globbing train/*.arrow read them too."""
    for path in manifest.unlisted_shard_files(output, result):
        os.remove(os.path.join(output, path))


def build_manifest(
    config: PrepareConfig,
    vocab_bytes: bytes,
    vocab_size: int,
    shard_entries: list[dict],
    reject_counts: dict[str, dict[str, int]],
    document_stats: dict,
    num_input_records: int,
    input_formats: list[tuple[str, str, str]] | tuple = (),
    working_directory: str | None = None,
) -> manifest.Manifest:
    """The manifest of a finished job; `input_formats`: (path, format, chosen_by) per file;
    `working_directory`: where the command ran, which its relative input paths are in."""
    splits = {}
    for split in config.shards_per_split():
        entries = sorted(
            (e for e in shard_entries if e["split"] == split), key=lambda e: e["index"]
        )
        shard_list = [
            manifest.ShardEntry(e["path"], e["num_rows"], e["num_tokens"], e["sha256"])
            for e in entries
        ]
        splits[split] = manifest.SplitEntry(
            num_instances=sum(e.num_rows for e in shard_list),
            num_tokens=sum(e.num_tokens for e in shard_list),
            num_documents=document_stats.get(split, (0, 0))[0],
            shards=shard_list,
        )
    counts = {
        # input_records = documents + rejected, but for empty_after_tokenization: such documents
        # are counted in their split before tokenization finds them empty (rare: control
        # characters only).
        "input_records": num_input_records,
        "documents": sum(s[0] for s in document_stats.values()),
        "sentences": sum(s[1] for s in document_stats.values()),
        "instances": sum(s.num_instances for s in splits.values()),
        "tokens": sum(s.num_tokens for s in splits.values()),
        "rejected": reject_counts["rejected"],
        # Records kept after a fix (invalid UTF-8 replaced, an overlong sentence cut).
        "repaired": reject_counts["repaired"],
    }
    tokenizer = manifest.TokenizerEntry(
        hashlib.sha256(vocab_bytes).hexdigest(), vocab_size, config.lower_case
    )
    return manifest.Manifest(
        tokenizer=tokenizer,
        instance_params=config.instance_params(),
        splits=splits,
        counts=counts,
        extra={"inputs": list(config.inputs),
               **({WORKING_DIRECTORY: working_directory} if working_directory else {})},
        input_files=_input_files(input_formats),
    )


def _input_files(input_formats) -> dict[str, dict]:
    """{path: {format, chosen_by, bytes}}: how each input was read, and its size, by which a
    later prepare into the same output sees a file that changed (`dataset_identity`)."""
    formats = sorted(set(map(tuple, input_formats)))
    sizes = sizes_of([path for path, _, _ in formats])
    return {path: {"format": fmt, "chosen_by": chosen_by, "bytes": sizes.get(path)}
            for path, fmt, chosen_by in formats}
