"""Masked-batch throughput on one core (bertforge vs Hugging Face), and padding saved by bucketing.

Both sides turn the same in-memory token ids into padded, masked batches of the same size (no
I/O): ours with the functions the loader uses (`rows_from_sequences` + `PretrainingCollator`,
per-sample masks keyed by (seed, epoch, index)); Hugging Face's with
`DataCollatorForLanguageModeling` over a `BertTokenizerFast` built from a local vocab file
(nothing is downloaded). Each side gets its input in the form it takes natively: uint16 arrays
(as memory-mapped shards give them) for ours, Python lists (as `datasets` gives them) for HF.
"rows checked" adds row validation as the loader does it (`training.data.integrity.check_rows`
on Arrow's layout, flat ids and offsets: ids in the vocabulary, lengths, [CLS]/[SEP]
positions, labels), a record batch of the pipeline's 4,096 rows at a time, each row once: the
first epoch's cost (later epochs pay nothing). Its share of the masking time is also printed
in CPU seconds, per record batch and per micro-batch (64 rows, the bound for tiny record
batches), timed in alternation with the masking (less noisy than two throughput runs on a
shared machine).

The second table is the share of padded positions per batch (padding / all positions) over
one epoch, with and without the loader's length bucketing (`bucket_order`, the same function the
loader calls), and with packing (`training.data.packing`, the loader's functions: up to 3
instances a row of max_seq_length; "packed": each micro-batch packed alone; "regrouped": the
loader's default, instances regrouped within each optimizer step so that micro-batches pack
well), on Google-like lengths (short_seq_prob 0.1) and, with `--data-dir`, on a prepared
dataset's real lengths. Rows count at their padded width (a multiple of 8) in every column.

    python benchmarks/masking_throughput.py [--vocab vocab.txt] [--batch-size 64]
        [--data-dir work/shards] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from bertforge.pipelines.write.global_order import ROWS_PER_BATCH
from bertforge.training.data import (
    MaskingOptions,
    PretrainingCollator,
    PretrainingLoader,
    padded_width,
    rows_from_sequences,
)
from bertforge.training.data.integrity import FlatRows, RowRules, check_rows
from bertforge.training.data.order import bucket_order, even_bucket_boundaries
from bertforge.training.data.packing import DEFAULT_MAX_PER_ROW, pack_layout, step_groups
from bertforge.training.masking import MaskingVocab, default_max_predictions

SHORT_SEQ_PROB = 0.1  # Google: 10 % of instances get a random shorter target length
# (micro-batch per rank, step batch): padding is per rank's batch; bucketing cuts step batches.
PADDING_LAYOUTS = ((32, 256), (64, 512), (256, 256))
PADDING_BUCKETINGS = ((8, 64), (16, 16), (16, 64))  # (bins, window in step batches)


def write_google_layout_vocab(path: str, size: int = 30_522) -> None:
    """A stand-in for Google's uncased vocab: same size, same special-token ids."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    num_rest = size - len(tokens)
    tokens += [f"word{i}" for i in range(num_rest * 4 // 5)]
    tokens += [f"##p{i}" for i in range(size - len(tokens))]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens) + "\n")


def make_samples(tokens: list[str], num: int, max_seq_length: int, seed: int = 0):
    """Pairs shaped like create_pretraining_data's: mostly full length, [CLS] A [SEP] B [SEP]."""
    rng = np.random.default_rng(seed)
    index = {t: i for i, t in enumerate(tokens)}
    ordinary = np.array([i for i, t in enumerate(tokens) if not t.startswith("[")])
    samples = []
    for _ in range(num):
        short = rng.random() < SHORT_SEQ_PROB
        length = int(rng.integers(8, max_seq_length)) if short else max_seq_length
        len_a = int(rng.integers(1, length - 3))
        body = rng.choice(ordinary, length - 3)
        ids = [index["[CLS]"], *body[:len_a], index["[SEP]"], *body[len_a:], index["[SEP]"]]
        samples.append((np.array(ids, dtype=np.uint16), len_a + 2, int(rng.integers(0, 2))))
    return samples


def ours(
    samples, tokens: list[str], max_seq_length: int, whole_word: bool, checked: bool = False
) -> Callable:
    """`checked`: each batch's rows validated first, as the loader validates a record batch."""
    rules = RowRules.from_vocab(tokens, max_seq_length) if checked else None
    flat = flat_rows(samples)
    collator = PretrainingCollator(
        MaskingVocab.from_tokens(tokens),
        MaskingOptions(default_max_predictions(max_seq_length), whole_word=whole_word),
        seed=0,
    )
    pad_id = tokens.index("[PAD]")
    ids, num_a, nsp = zip(*samples, strict=True)

    def one_batch(start: int, batch_size: int):
        part = slice(start, start + batch_size)
        rows = rows_from_sequences(
            ids[part], num_a[part], nsp[part], np.arange(start, start + batch_size), pad_id
        )
        if rules is not None and start % ROWS_PER_BATCH < batch_size:  # a new record batch
            first = start - start % ROWS_PER_BATCH
            check_rows(flat_slice(flat, first, ROWS_PER_BATCH), rules, "in memory")
        return collator(rows, epoch=0)

    return one_batch


def hugging_face(samples, vocab_path: str) -> Callable:
    from transformers import BertTokenizerFast, DataCollatorForLanguageModeling

    tokenizer = BertTokenizerFast(vocab_file=vocab_path, do_lower_case=True)
    collator = DataCollatorForLanguageModeling(
        tokenizer, mlm=True, mlm_probability=0.15, pad_to_multiple_of=8, return_tensors="pt"
    )
    features = [
        {
            "input_ids": ids.tolist(),
            "token_type_ids": [0] * num_a + [1] * (len(ids) - num_a),
            "next_sentence_label": nsp,
        }
        for ids, num_a, nsp in samples
    ]

    def one_batch(start: int, batch_size: int):
        return collator(features[start : start + batch_size])

    return one_batch


def flat_rows(samples) -> FlatRows:
    """All samples in Arrow's list layout, as a shard's record batch holds them."""
    ids, num_a, nsp = zip(*samples, strict=True)
    offsets = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int32)
    return FlatRows(offsets, np.concatenate(ids), np.array(num_a, dtype=np.uint16),
                    np.array(nsp, dtype=np.int8))


def flat_slice(flat: FlatRows, start: int, count: int) -> FlatRows:
    """Rows start..start+count: their offsets still index the shared values (zero-copy)."""
    return FlatRows(flat.offsets[start : start + count + 1], flat.values,
                    flat.num_a_tokens[start : start + count],
                    flat.next_sentence_label[start : start + count])


def validation_share(
    samples, tokens: list[str], length: int, batch_size: int, rows_per_check: int
) -> float:
    """CPU time of `check_rows` over all samples, `rows_per_check` rows a call, / CPU time of
    the collator on them, timed in alternation: CPU time, not the wall clock, so that other
    processes on a shared machine (which preempt short calls unevenly) do not count."""
    rules = RowRules.from_vocab(tokens, length)
    collator = PretrainingCollator(MaskingVocab.from_tokens(tokens),
                                   MaskingOptions(default_max_predictions(length)), seed=0)
    pad_id = tokens.index("[PAD]")
    ids, num_a, nsp = zip(*samples, strict=True)
    flat = flat_rows(samples)
    check_seconds = mask_seconds = 0.0
    for start in range(0, len(samples) - batch_size + 1, batch_size):
        part = slice(start, start + batch_size)
        rows = rows_from_sequences(ids[part], num_a[part], nsp[part],
                                   np.arange(start, start + batch_size), pad_id)
        began = time.process_time()
        if start % rows_per_check < batch_size:
            first = start - start % rows_per_check
            check_rows(flat_slice(flat, first, rows_per_check), rules, "in memory")
        checked = time.process_time()
        collator(rows, epoch=0)
        mask_seconds += time.process_time() - checked
        check_seconds += checked - began
    return check_seconds / mask_seconds


def batches_per_second(one_batch: Callable, num_samples: int, batch_size: int, repeats: int):
    """Median over `repeats` passes over all samples (the machine may be shared)."""
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        num_batches = 0
        for start in range(0, num_samples - batch_size + 1, batch_size):
            one_batch(start, batch_size)
            num_batches += 1
        rates.append(num_batches / (time.perf_counter() - started))
    return statistics.median(rates)


def padding_share(order: np.ndarray, lengths: np.ndarray, micro_batch: int) -> float:
    """Padded positions / all positions over the full micro-batches of `order`."""
    rows = lengths[order[: len(order) // micro_batch * micro_batch]].reshape(-1, micro_batch)
    widths = np.array([padded_width(int(m)) for m in rows.max(axis=1)])
    return 1.0 - rows.sum() / (widths.sum() * micro_batch)


def bucketed_share(
    lengths: np.ndarray, max_length: int, micro: int, step: int, bins: int | None, window: int
) -> float:
    """The padding share of epoch 0's order, as the loader builds it (seed 0)."""
    generator = np.random.default_rng([0, 0])
    order = generator.permutation(len(lengths))
    if bins is not None:
        edges = even_bucket_boundaries(max_length, bins)
        order = bucket_order(order, lengths, edges, step, window, generator)
    return padding_share(order, lengths, micro)


def packed_share(
    lengths: np.ndarray, max_length: int, micro: int, step: int, regroup: bool
) -> float:
    """The padding share of epoch 0's order (seed 0) packed as the loader packs it, over the
    full optimizer steps (one rank: the global batch is the micro-batch)."""
    order = np.random.default_rng([0, 0]).permutation(len(lengths))
    positions = real = 0
    for start in range(0, len(order) // step * step, step):
        members = order[start : start + step]
        if regroup:
            members = members[step_groups(lengths[members], max_length, DEFAULT_MAX_PER_ROW,
                                          micro, micro)]
        for first in range(0, step, micro):
            part = lengths[members[first : first + micro]]
            layout = pack_layout(part, max_length, DEFAULT_MAX_PER_ROW)
            positions += layout.num_rows * layout.width
            real += int(part.sum())
    return 1.0 - real / positions


def padding_table(datasets: dict[str, tuple[np.ndarray, int]]) -> None:
    print("\npadded share of batch positions, one epoch (lower is better)")
    columns = ["none"] + [f"{bins} bins, w{window}" for bins, window in PADDING_BUCKETINGS]
    columns += ["packed", "regrouped"]
    print(f"{'lengths':<26} {'micro/step':>10} " + " ".join(f"{c:>13}" for c in columns))
    for name, (lengths, max_length) in datasets.items():
        for micro, step in PADDING_LAYOUTS:
            if step > len(lengths):
                continue
            shares = [bucketed_share(lengths, max_length, micro, step, None, 1)]
            shares += [
                bucketed_share(lengths, max_length, micro, step, bins, window)
                for bins, window in PADDING_BUCKETINGS
            ]
            shares += [packed_share(lengths, max_length, micro, step, regroup)
                       for regroup in (False, True)]
            print(
                f"{name:<26} {f'{micro}/{step}':>10} "
                + " ".join(f"{share:>12.1%} " for share in shares)
            )


def padding_datasets(tokens: list[str], args: argparse.Namespace) -> dict:
    """Google-like lengths at each benchmark length, plus a prepared dataset's if given."""
    datasets = {
        f"Google-like, {length}": (
            np.array([len(ids) for ids, _, _ in make_samples(tokens, 65_536, length, seed=1)]),
            length,
        )
        for length in args.lengths
    }
    if args.data_dir:
        loader = PretrainingLoader(args.data_dir, batch_size=1, seed=0, prefetch=0)
        where = os.path.normpath(args.data_dir).split(os.sep)[-2:]
        name = f"{'/'.join(where)}, {loader.max_seq_length}"
        datasets[name] = (loader.sample_lengths().astype(np.int64), loader.max_seq_length)
    return datasets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", help="a vocab.txt (default: a Google-layout stand-in)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--samples", type=int, default=4096, help="per length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", help="a prepared dataset: its lengths join the padding table")
    parser.add_argument("--skip-throughput", action="store_true", help="the padding table only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core: the figure a data-loading worker gets

    with tempfile.TemporaryDirectory() as scratch:
        vocab_path = args.vocab or os.path.join(scratch, "vocab.txt")
        if not args.vocab:
            write_google_layout_vocab(vocab_path)
        with open(vocab_path, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f if line.strip()]
        if not args.skip_throughput:
            throughput_table(tokens, vocab_path, args)
        padding_table(padding_datasets(tokens, args))


def throughput_table(tokens: list[str], vocab_path: str, args: argparse.Namespace) -> None:
    print(f"batch size {args.batch_size}, vocab {len(tokens)} tokens, one thread")
    print(f"{'length':>6} {'collator':<24} {'batches/s':>10} {'samples/s':>10} {'ours/HF':>8}")
    for length in args.lengths:
        samples = make_samples(tokens, args.samples, length)
        candidates = [
            ("bertforge", ours(samples, tokens, length, whole_word=False)),
            ("bertforge, rows checked", ours(samples, tokens, length, False, checked=True)),
            ("bertforge whole-word", ours(samples, tokens, length, whole_word=True)),
            ("HF DataCollatorForLM", hugging_face(samples, vocab_path)),
        ]
        rates = {
            name: batches_per_second(fn, len(samples), args.batch_size, args.repeats)
            for name, fn in candidates
        }
        hf = rates["HF DataCollatorForLM"]
        for name, rate in rates.items():
            print(
                f"{length:>6} {name:<24} {rate:>10.1f} {rate * args.batch_size:>10.0f} "
                f"{rate / hf:>7.2f}x"
            )
        shares = [validation_share(samples, tokens, length, args.batch_size, rows)
                  for rows in (ROWS_PER_BATCH, args.batch_size)]
        print(f"{length:>6} row checks cost {shares[0]:.1%} of the masking time by record "
              f"batch of {ROWS_PER_BATCH:,} rows, {shares[1]:.1%} by {args.batch_size} rows "
              "(CPU time, interleaved; first epoch only)")


if __name__ == "__main__":
    main()
