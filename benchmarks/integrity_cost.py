"""What checking the data costs at start-up: sha256 speed, and a real dataset's first batch with
and without the background checksum verification.

    python benchmarks/integrity_cost.py --data-dir DIR [--batch-size 32] [--hash-mb 256]

Prints sha256 MB/s on this machine (in memory, and a file through `sha256_file` with the page
cache warm), the estimate for verifying a 10 GB dataset (what a synchronous check would add to
every worker's start), and for DIR's train split: the loader's construction and first batch
with verification on (the default: hashing runs in a background thread) and off, and how long
after the loader was built all verdicts were in.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

import numpy as np

from bertforge.pipelines.contract.manifest import read_manifest, sha256_file
from bertforge.training.data import (
    MaskingOptions,
    PretrainingCollator,
    PretrainingLoader,
    ReadOptions,
)
from bertforge.training.data.integrity import check_rows
from bertforge.training.data.mapped_shards import open_shard
from bertforge.training.data.split import open_split
from bertforge.training.dataset_facts import DatasetFacts
from bertforge.training.masking import MaskingVocab

TEN_GB = 10e9


def hash_rates(megabytes: int) -> tuple[float, float, float]:
    """sha256 MB/s: in memory, through a warm file (wall clock), and that file per CPU second
    (what one quiet core does: on a shared machine the wall clock also counts the waiting)."""
    block = os.urandom(1 << 20)
    started = time.perf_counter()
    digest = hashlib.sha256()
    for _ in range(megabytes):
        digest.update(block)
    memory = megabytes / (time.perf_counter() - started)
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        for _ in range(megabytes):
            f.write(block)
        f.flush()
        sha256_file(f.name)  # warm the page cache: measure hashing, not the disk
        started, cpu_started = time.perf_counter(), time.process_time()
        sha256_file(f.name)
        file_rate = megabytes / (time.perf_counter() - started)
        cpu_rate = megabytes / (time.process_time() - cpu_started)
    return memory, file_rate, cpu_rate


def first_batch(data_dir: str, batch_size: int, verify: bool) -> tuple[float, float, float]:
    """(seconds to build the loader, to its first batch, until every checksum verdict is in)."""
    started = time.perf_counter()
    loader = PretrainingLoader(data_dir, batch_size=batch_size, seed=0, prefetch=0,
                               read=ReadOptions(verify_checksums=verify))
    built = time.perf_counter()
    next(iter(loader))
    first = time.perf_counter()
    loader.wait_for_checksums()
    return built - started, first - started, time.perf_counter() - started


def validation_share(data_dir: str, batch_size: int, num_batches: int = 100) -> tuple:
    """(CPU seconds validating every record batch of the train split once, CPU seconds of
    gathering and masking one epoch of it: estimated from `num_batches` random batches)."""
    opened = open_split(data_dir, "train", ReadOptions(verify_checksums=False))
    entries = opened.manifest.splits["train"].shards
    segments = [segment for entry in entries
                for segment in open_shard(os.path.join(data_dir, entry.path), entry.num_rows)]
    began = time.process_time()
    for segment in segments:
        check_rows(segment, opened.rules, segment.path, segment.first_row)
    validation = time.process_time() - began
    pad_id = opened.vocab_tokens.index("[PAD]")
    facts = DatasetFacts.from_manifest(opened.manifest, data_dir)
    collator = PretrainingCollator(MaskingVocab.from_tokens(opened.vocab_tokens),
                                   MaskingOptions().for_dataset(facts), seed=0)
    rng = np.random.default_rng(0)
    began = time.process_time()
    for _ in range(num_batches):
        indices = rng.choice(opened.rows.num_rows, batch_size, replace=False)
        collator(opened.rows.gather(indices, pad_id), epoch=0)  # no rules: timed apart
    per_batch = (time.process_time() - began) / num_batches
    return validation, per_batch * opened.rows.num_rows / batch_size, len(segments)


def split_bytes(data_dir: str) -> int:
    shards = read_manifest(data_dir).splits["train"].shards
    return sum(os.path.getsize(os.path.join(data_dir, entry.path)) for entry in shards)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True, help="a prepared dataset (e.g. the demo's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hash-mb", type=int, default=256, help="megabytes hashed for the rate")
    args = parser.parse_args(argv)

    memory, file_rate, cpu_rate = hash_rates(args.hash_mb)
    print(f"sha256: {memory:,.0f} MB/s in memory, {file_rate:,.0f} MB/s through sha256_file "
          f"(warm page cache), {cpu_rate:,.0f} MB per CPU second; a 10 GB dataset: "
          f"{TEN_GB / 1e6 / file_rate:,.1f} s per process at the wall-clock rate, "
          f"{TEN_GB / 1e6 / cpu_rate:,.1f} s on a quiet core, if verified before the first step")
    size = split_bytes(args.data_dir)
    print(f"{args.data_dir}: train split {size / 1e6:,.1f} MB "
          f"({size / 1e6 / file_rate:.2f} s of hashing at that rate)")
    # A first loader warms the page cache and the lazy imports; then verification on (its
    # verdicts are cached per process, so it is measured once), then off again.
    first_batch(args.data_dir, args.batch_size, verify=False)
    for verify in (True, False):
        built, first, verified = first_batch(args.data_dir, args.batch_size, verify)
        label = "verify on (background)" if verify else "verify off"
        print(f"  {label:<24} loader built {built:6.3f} s, first batch {first:6.3f} s"
              + (f", all checksums verified {verified:6.3f} s" if verify else ""))
    validation, epoch, num_segments = validation_share(args.data_dir, args.batch_size)
    print(f"row validation: {validation:.3f} CPU s for all {num_segments} record batches of the "
          f"split (each once per process), {validation / epoch:.2%} of the CPU time of the first "
          f"epoch's gathering and masking ({epoch:.1f} s at batch {args.batch_size}), 0 after")

if __name__ == "__main__":
    main()
