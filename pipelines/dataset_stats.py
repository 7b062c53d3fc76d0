"""Statistics of a prepared dataset: counts, NSP balance, lengths, and a few decoded pairs.

Reads the shards through memory maps, so inspecting a large dataset costs little memory; checks
row counts against the manifest and every row against the data contract (`contract.rows`, the
training loader's checks) on the way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bertforge.pipelines.contract import manifest
from bertforge.pipelines.contract.rows import RowRules, table_problem
from bertforge.pipelines.contract.tokenization import UNKNOWN_TOKEN, load_tokenizer, read_vocab
from bertforge.pipelines.verify_dataset import read_arrow_file

NUM_LENGTH_BINS = 8


def _read_shard(path: str) -> pa.Table:
    return read_arrow_file(path)  # names the file when it is not Arrow


def _length_histogram(lengths: np.ndarray, max_seq_length: int) -> list[dict[str, int]]:
    """Equal-width bins over [0, max_seq_length]; bin `i` counts lengths in (from, to]."""
    edges = np.linspace(0, max_seq_length, NUM_LENGTH_BINS + 1).round().astype(int)
    counts, _ = (
        np.histogram(lengths, bins=edges + 0.5)
        if len(lengths)
        else (np.zeros(NUM_LENGTH_BINS), None)
    )
    return [
        {"from": int(edges[i]), "to": int(edges[i + 1]), "count": int(counts[i])}
        for i in range(NUM_LENGTH_BINS)
    ]


def _split_stats(
    data_dir: str, entry: manifest.SplitEntry, max_seq_length: int, rules: RowRules,
    unknown_id: int,
) -> dict[str, Any]:
    lengths, labels, num_a, problems = [], [], [], []
    num_unknown = 0
    for shard in entry.shards:
        table = _read_shard(os.path.join(data_dir, shard.path))
        if table.num_rows != shard.num_rows:
            problems.append(f"{shard.path}: {table.num_rows} rows, manifest says {shard.num_rows}")
        problem = table_problem(table, rules, shard.path)  # a damaged file (see --verify)
        if problem:
            problems.append(problem)
        lengths.append(
            pc.list_value_length(table[manifest.INPUT_IDS]).to_numpy(zero_copy_only=False)
        )
        labels.append(table[manifest.NEXT_SENTENCE_LABEL].to_numpy())
        ids = pc.list_flatten(table[manifest.INPUT_IDS])
        num_unknown += pc.sum(pc.equal(ids, unknown_id)).as_py() or 0
        num_a.append(table[manifest.NUM_A_TOKENS].to_numpy())
    length = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    label = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int8)
    a_tokens = np.concatenate(num_a) if num_a else np.zeros(0, dtype=np.uint16)
    num_rows = int(len(length))
    num_random = int((label == 1).sum())
    return {
        "num_rows": num_rows,
        "num_tokens": int(length.sum()),
        "num_shards": len(entry.shards),
        "num_documents": entry.num_documents,
        "shard_rows": [s.num_rows for s in entry.shards],
        "nsp": {
            "real_next": num_rows - num_random,
            "random_next": num_random,
            "random_share": num_random / num_rows if num_rows else 0.0,
        },
        "length": {
            "mean": float(length.mean()) if num_rows else 0.0,
            "min": int(length.min()) if num_rows else 0,
            "max": int(length.max()) if num_rows else 0,
            "num_full": int((length == max_seq_length).sum()),
            "histogram": _length_histogram(length, max_seq_length),
        },
        "num_a_tokens_mean": float(a_tokens.mean()) if num_rows else 0.0,
        # A vocabulary that does not fit the text shows here (prepare warns of it too).
        "unknown_share": num_unknown / int(length.sum()) if num_rows else 0.0,
        "problems": problems,
    }


def _samples(
    data_dir: str, entry: manifest.SplitEntry, lower_case: bool, num_samples: int
) -> list[dict]:
    """The first rows of the split's first non-empty shard, segments A and B decoded apart."""
    tokenizer = load_tokenizer(os.path.join(data_dir, manifest.VOCAB_NAME), lower_case)
    for shard in entry.shards:
        if shard.num_rows == 0:
            continue
        rows = _read_shard(os.path.join(data_dir, shard.path)).slice(0, num_samples).to_pylist()
        return [
            {
                "doc_id": row[manifest.DOC_ID],
                "next_sentence_label": row[manifest.NEXT_SENTENCE_LABEL],
                "num_tokens": len(row[manifest.INPUT_IDS]),
                # [CLS] A [SEP] | B [SEP]: A is ids[1 : num_a - 1], B is ids[num_a : -1].
                "a": tokenizer.decode(row[manifest.INPUT_IDS][1 : row[manifest.NUM_A_TOKENS] - 1]),
                "b": tokenizer.decode(row[manifest.INPUT_IDS][row[manifest.NUM_A_TOKENS] : -1]),
            }
            for row in rows
        ]
    return []


def inspect_dataset(data_dir: str, num_samples: int = 3) -> dict[str, Any]:
    """Statistics of every split of the dataset in `data_dir`, plus decoded sample pairs."""
    found = manifest.read_manifest(data_dir)
    max_seq_length = found.instance_param("max_seq_length", data_dir)
    vocab_path = os.path.join(data_dir, manifest.VOCAB_NAME)
    if not os.path.isfile(vocab_path):
        raise FileNotFoundError(f"{vocab_path} is missing: every prepared dataset holds the "
                                "vocabulary its ids index (copy it back from where the dataset "
                                "was made; `--verify` checks the whole dataset)")
    vocab = read_vocab(vocab_path)
    rules = RowRules.from_vocab(sorted(vocab, key=vocab.__getitem__), max_seq_length,
                                found.tokenizer.vocab_size)
    splits = {
        name: _split_stats(data_dir, entry, max_seq_length, rules, vocab.get(UNKNOWN_TOKEN, -1))
        for name, entry in found.splits.items()
    }
    sample_split = "train" if "train" in found.splits else next(iter(found.splits), None)
    samples = []
    if sample_split is not None and num_samples > 0:
        samples = _samples(
            data_dir, found.splits[sample_split], found.tokenizer.lower_case, num_samples
        )
    return {
        "data_dir": data_dir,
        "tokenizer": {
            "vocab_size": found.tokenizer.vocab_size,
            "lower_case": found.tokenizer.lower_case,
        },
        "instance_params": found.instance_params,
        "counts": found.counts,
        "splits": splits,
        "sample_split": sample_split,
        "samples": samples,
    }


def _format_split(name: str, split: dict[str, Any]) -> list[str]:
    nsp, length = split["nsp"], split["length"]
    lines = [
        f"{name}: {split['num_rows']:,} instances, {split['num_tokens']:,} tokens, "
        f"{split['num_documents']:,} documents, {split['num_shards']} "
        f"shard{'' if split['num_shards'] == 1 else 's'} "
        f"(rows {min(split['shard_rows'], default=0)}-{max(split['shard_rows'], default=0)})",
        f"  NSP: {nsp['real_next']:,} real next, {nsp['random_next']:,} random "
        f"({100 * nsp['random_share']:.1f} % random)",
        f"  length: mean {length['mean']:.1f}, min {length['min']}, max {length['max']}, "
        f"{length['num_full']:,} at max_seq_length; "
        f"mean [CLS] A [SEP] {split['num_a_tokens_mean']:.1f}",
        f"  [UNK]: {100 * split['unknown_share']:.2f} % of the tokens",
    ]
    peak = max((b["count"] for b in length["histogram"]), default=0) or 1
    for b in length["histogram"]:
        bar = "#" * round(40 * b["count"] / peak)
        lines.append(f"    {b['from']:>4}-{b['to']:<4} {b['count']:>9,} {bar}")
    lines += [f"  PROBLEM: {p}" for p in split["problems"]]
    return lines


def format_report(stats: dict[str, Any]) -> str:
    """A plain-text report of `inspect_dataset`'s statistics."""
    counts = stats["counts"]
    rejected = counts.get("rejected", {})
    lines = [
        f"dataset {stats['data_dir']}",
        f"tokenizer: {stats['tokenizer']['vocab_size']:,} pieces, "
        f"{'lower-cased' if stats['tokenizer']['lower_case'] else 'cased'}",
        "params: " + ", ".join(f"{k}={v}" for k, v in sorted(stats["instance_params"].items())),
        f"documents: {counts.get('documents', 0):,} kept "
        f"of {counts.get('input_records', 0):,} input records; "
        f"{counts.get('sentences', 0):,} sentences; rejected: "
        + (", ".join(f"{k} {v:,}" for k, v in sorted(rejected.items())) or "none"),
    ]
    for name, split in stats["splits"].items():
        lines += _format_split(name, split)
    if stats["samples"]:
        lines.append(f"samples ({stats['sample_split']}):")
    for i, sample in enumerate(stats["samples"]):
        label = "random next" if sample["next_sentence_label"] == 1 else "real next"
        lines += [
            f"  [{i}] {sample['doc_id']} ({label}, {sample['num_tokens']} tokens)",
            f"      A: {sample['a']}",
            f"      B: {sample['b']}",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_report(inspect_dataset(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)))
