"""The pretraining loader: memory-mapped Arrow shards in, masked padded batches out.

A prepared dataset (see `pipelines/manifest.py`) holds one row per sentence pair. This module
opens a split, checks it against its manifest, and yields batches with Hugging Face names
(`input_ids`, `token_type_ids`, `attention_mask`, `labels`, `next_sentence_label`) that
`transformers.BertForPreTraining` accepts unchanged.

Order and masks are functions of (seed, epoch, global sample index) only (DESIGN,
"Determinism"): the order of an epoch is a permutation from a Generator seeded with
(seed, epoch); global batch g is `permutation[g * G:(g + 1) * G]` with G = batch_size x
world_size, and rank r takes the r-th slice of it. So the sequence of global batches is the same
for any number of ranks with the same global batch, and the loader's position, counted in global
batches, resumes exactly, even on a different number of ranks.

Memory stays flat in the dataset size: shards are memory-mapped (a row is one seek away) and a
batch gathers only its own rows; the one O(N) structure is the epoch's permutation, 4 bytes a
sample.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from pipelines import manifest as manifest_lib
from pipelines.tokenization import read_vocab
from training.masking import (
    MaskingVocab,
    SampleStreams,
    default_max_predictions,
    mask_batch,
)

PAD_MULTIPLE = 8  # tensor cores want sequence lengths in multiples of 8
STATE_VERSION = 1
_REQUIRED_COLUMNS = (
    manifest_lib.INPUT_IDS,
    manifest_lib.NUM_A_TOKENS,
    manifest_lib.NEXT_SENTENCE_LABEL,
)


# ---------------------------------------------------------------------------------------------
# Rows: gathering from shards, and the same layout built from in-memory sequences.


@dataclass(frozen=True)
class RowBatch:
    """Unmasked rows of one batch: ids padded to a multiple of 8, plus per-row fields."""

    input_ids: np.ndarray  # int64[B, L], [PAD] past each row's length
    lengths: np.ndarray  # int64[B]
    num_a_tokens: np.ndarray  # int64[B], length of [CLS] A [SEP]
    next_sentence_label: np.ndarray  # int64[B]
    sample_indices: np.ndarray  # int64[B], global index in the split: keys the mask


def padded_width(max_length: int, multiple: int = PAD_MULTIPLE) -> int:
    """The longest row rounded up to a multiple of 8 (at least 8)."""
    return max(multiple, -(-max_length // multiple) * multiple)


def rows_from_sequences(
    sequences: Sequence[np.ndarray],
    num_a_tokens: Sequence[int] | np.ndarray,
    next_sentence_label: Sequence[int] | np.ndarray,
    sample_indices: Sequence[int] | np.ndarray,
    pad_id: int,
) -> RowBatch:
    """A `RowBatch` from in-memory id sequences (tests, benchmarks, custom pipelines)."""
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    input_ids = np.full((len(sequences), padded_width(int(lengths.max(initial=0)))), pad_id)
    real = np.arange(input_ids.shape[1]) < lengths[:, None]
    if len(sequences):
        input_ids[real] = np.concatenate(sequences)  # row-major order matches concatenation
    return RowBatch(
        input_ids=input_ids.astype(np.int64, copy=False),
        lengths=lengths,
        num_a_tokens=np.asarray(num_a_tokens, dtype=np.int64),
        next_sentence_label=np.asarray(next_sentence_label, dtype=np.int64),
        sample_indices=np.asarray(sample_indices, dtype=np.int64),
    )


@dataclass(frozen=True)
class _Segment:
    """One record batch of one shard: zero-copy numpy views of the memory map."""

    offsets: np.ndarray  # list offsets into values, num_rows + 1
    values: np.ndarray  # flat token ids (uint16, or int32 for large vocabularies)
    num_a_tokens: np.ndarray
    next_sentence_label: np.ndarray


class _ShardRows:
    """Random access by global row index over the segments of a split, in manifest order."""

    def __init__(self, segments: list[_Segment]):
        self._segments = segments
        self._starts = np.cumsum([0] + [len(s.num_a_tokens) for s in segments], dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def gather(self, indices: np.ndarray, pad_id: int) -> RowBatch:
        """The rows `indices`, in that order, padded; reads only the pages those rows live on."""
        indices = np.asarray(indices, dtype=np.int64)
        segment_of = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[segment_of]
        groups = _group_by(segment_of)
        begins, lengths = np.zeros((2, len(indices)), dtype=np.int64)
        num_a, nsp = np.zeros((2, len(indices)), dtype=np.int64)
        for segment_index, rows in groups:
            segment, at = self._segments[segment_index], local[rows]
            begins[rows] = segment.offsets[at]
            lengths[rows] = segment.offsets[at + 1] - begins[rows]
            num_a[rows] = segment.num_a_tokens[at]
            nsp[rows] = segment.next_sentence_label[at]
        input_ids = np.full((len(indices), padded_width(int(lengths.max(initial=0)))), pad_id)
        positions = np.arange(input_ids.shape[1])
        for segment_index, rows in groups:
            values = self._segments[segment_index].values
            flat = np.minimum(begins[rows, None] + positions, len(values) - 1)
            real = positions < lengths[rows, None]
            input_ids[rows] = np.where(real, values[flat], pad_id)
        return RowBatch(input_ids.astype(np.int64, copy=False), lengths, num_a, nsp, indices)

    def iter_token_ids(self) -> Iterator[np.ndarray]:
        for segment in self._segments:
            yield segment.values[segment.offsets[0] : segment.offsets[-1]]


def _group_by(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, positions holding it) for each distinct key, via one stable sort."""
    order = np.argsort(keys, kind="stable")
    boundaries = np.flatnonzero(np.diff(keys[order])) + 1
    return [(int(keys[part[0]]), part) for part in np.split(order, boundaries) if len(part)]


# ---------------------------------------------------------------------------------------------
# Opening and checking a split.


def _open_shard(path: str, expected_rows: int) -> list[_Segment]:
    """Memory-map one shard and check it; every error names the file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"shard {path} is missing (the manifest lists it)")
    try:
        with pa.memory_map(path) as source:
            # Buffers keep the mapping alive after the file closes: no descriptor per shard.
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except (pa.ArrowException, OSError) as error:
        raise ValueError(
            f"shard {path} is corrupt or truncated: not a readable Arrow IPC file ({error})"
        ) from error
    missing = [name for name in _REQUIRED_COLUMNS if name not in schema.names]
    if missing:
        raise ValueError(f"shard {path} lacks the columns {missing} (has {schema.names})")
    num_rows = sum(batch.num_rows for batch in batches)
    if num_rows != expected_rows:
        raise ValueError(
            f"shard {path} has {num_rows} rows but the manifest says {expected_rows}: "
            "it is truncated or was replaced after preparation"
        )
    return [_segment(path, batch) for batch in batches if batch.num_rows]


def _segment(path: str, batch: pa.RecordBatch) -> _Segment:
    ids = batch.column(manifest_lib.INPUT_IDS)
    try:
        return _Segment(
            offsets=ids.offsets.to_numpy(),
            values=ids.values.to_numpy(zero_copy_only=True),
            num_a_tokens=batch.column(manifest_lib.NUM_A_TOKENS).to_numpy(zero_copy_only=True),
            next_sentence_label=batch.column(manifest_lib.NEXT_SENTENCE_LABEL).to_numpy(
                zero_copy_only=True
            ),
        )
    except (pa.ArrowException, AttributeError) as error:
        raise ValueError(f"shard {path} has unexpected column types ({error})") from error


def _read_vocab_tokens(data_dir: str, tokenizer: manifest_lib.TokenizerEntry) -> list[str]:
    """vocab.txt in id order, checked against the manifest's hash and size."""
    path = os.path.join(data_dir, manifest_lib.VOCAB_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: the dataset's vocabulary is part of it")
    if manifest_lib.sha256_file(path) != tokenizer.vocab_sha256:
        raise ValueError(f"{path} does not match the sha256 recorded in the manifest")
    vocab = read_vocab(path)
    tokens = sorted(vocab, key=vocab.__getitem__)
    if len(tokens) != tokenizer.vocab_size:
        raise ValueError(
            f"{path} has {len(tokens)} tokens, the manifest says {tokenizer.vocab_size}"
        )
    return tokens


def _open_split(
    data_dir: str, split: str, verify_checksums: bool
) -> tuple[manifest_lib.Manifest, _ShardRows]:
    """(manifest, rows) of a local dataset directory's split, checked shard by shard."""
    manifest = manifest_lib.read_manifest(data_dir)
    if split not in manifest.splits:
        raise ValueError(f"{data_dir} has no split {split!r} (it has {sorted(manifest.splits)})")
    segments: list[_Segment] = []
    for entry in manifest.splits[split].shards:
        path = os.path.join(data_dir, entry.path)
        segments += _open_shard(path, entry.num_rows)
        if verify_checksums and manifest_lib.sha256_file(path) != entry.sha256:
            raise ValueError(f"shard {path} does not match its sha256 in the manifest")
    return manifest, _ShardRows(segments)


# ---------------------------------------------------------------------------------------------
# Remote datasets (gs://, s3://, ...): copied once into a local cache, then memory-mapped.


def _local_dataset_dir(data_dir: str, split: str, cache_dir: str | None) -> str:
    """`data_dir` itself when local; else a local copy of its manifest, vocab and split."""
    if "://" not in data_dir:
        return data_dir
    filesystem, root = pafs.FileSystem.from_uri(data_dir)
    if isinstance(filesystem, pafs.LocalFileSystem):
        return root
    return download_split(filesystem, root, split, cache_dir)


def download_split(
    filesystem: pafs.FileSystem, root: str, split: str, cache_dir: str | None = None
) -> str:
    """Copy a dataset's manifest, vocab and one split's shards to a local directory.

    The copy lives under `cache_dir/<hash of the manifest>`, so a re-prepared dataset never
    mixes with an old copy; a shard already there with the right size is not fetched again,
    and each copy lands under a temporary name first, so an interrupted one never counts.
    Memory-mapping needs a local file; this keeps memory flat for remote data too.
    """
    manifest_path = f"{root.rstrip('/')}/{manifest_lib.MANIFEST_NAME}"
    try:
        with filesystem.open_input_stream(manifest_path) as stream:
            manifest_bytes = stream.read()
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{manifest_path} not found: not a prepared dataset, or its preparation did not "
            "finish (the manifest is written last)"
        ) from error
    cache_root = cache_dir or os.path.join(tempfile.gettempdir(), "bertforge-datasets")
    target = os.path.join(cache_root, hashlib.sha256(manifest_bytes).hexdigest()[:16])
    os.makedirs(target, exist_ok=True)
    manifest = manifest_lib.Manifest.from_dict(json.loads(manifest_bytes))
    if split not in manifest.splits:
        raise ValueError(f"{root} has no split {split!r} (it has {sorted(manifest.splits)})")
    shard_paths = [entry.path for entry in manifest.splits[split].shards]
    for relative in [manifest_lib.VOCAB_NAME, *shard_paths]:
        _fetch(filesystem, f"{root.rstrip('/')}/{relative}", os.path.join(target, relative))
    manifest_lib.write_manifest(target, manifest)  # last, as in the original
    return target


def _fetch(filesystem: pafs.FileSystem, source: str, destination: str) -> None:
    info = filesystem.get_file_info(source)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"shard or vocabulary {source} is missing (the manifest lists it)")
    if os.path.exists(destination) and os.path.getsize(destination) == info.size:
        return
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    partial = destination + ".partial"
    with filesystem.open_input_stream(source) as stream, open(partial, "wb") as out:
        while chunk := stream.read(1 << 24):
            out.write(chunk)
    os.replace(partial, destination)


# ---------------------------------------------------------------------------------------------
# Collation: rows -> masked tensors.


class PretrainingCollator:
    """Masks a `RowBatch` (dynamically: per (seed, epoch, sample index)) into HF tensors."""

    def __init__(
        self,
        vocab: MaskingVocab,
        *,
        seed: int,
        max_predictions: int,
        mask_prob: float = 0.15,
        whole_word: bool = False,
    ):
        if not 0.0 < mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
        if max_predictions < 1:
            raise ValueError(f"max_predictions must be >= 1, got {max_predictions}")
        self.vocab = vocab
        self.seed = seed
        self.max_predictions = max_predictions
        self.mask_prob = mask_prob
        self.whole_word = whole_word

    def __call__(self, rows: RowBatch, epoch: int) -> dict[str, torch.Tensor]:
        # A SampleStreams per call keeps this thread-safe; building one costs ~10 us.
        uniforms = SampleStreams(self.seed, epoch).batch_uniforms(
            rows.sample_indices, rows.lengths, rows.input_ids.shape[1]
        )
        masked, labels = mask_batch(
            rows.input_ids,
            rows.lengths,
            uniforms,
            self.vocab,
            max_predictions=self.max_predictions,
            mask_prob=self.mask_prob,
            whole_word=self.whole_word,
        )
        positions = np.arange(rows.input_ids.shape[1])
        real = positions < rows.lengths[:, None]
        segment_b = real & (positions >= rows.num_a_tokens[:, None])
        return {
            "input_ids": torch.from_numpy(masked),
            "token_type_ids": torch.from_numpy(segment_b.astype(np.int64)),
            "attention_mask": torch.from_numpy(real.astype(np.int64)),
            "labels": torch.from_numpy(labels),
            "next_sentence_label": torch.from_numpy(rows.next_sentence_label),
        }


# ---------------------------------------------------------------------------------------------
# The loader.


class PretrainingLoader:
    """Batches of one split for one rank, resumable to the exact batch.

    Args:
        data_dir: a prepared dataset: a local path, or a `pyarrow.fs` URI (`gs://...`), which is
            copied once to `cache_dir` and memory-mapped from there.
        split: "train" or "validation".
        batch_size: per rank; the global batch is `batch_size x world_size`.
        seed: order and masks derive from it (with the epoch and sample index).
        rank, world_size: this worker's slice of every global batch.
        max_predictions: per sequence; default Google's (20 at 128 tokens, 80 at 512).
        mask_prob, whole_word: masking rules (see `training.masking`).
        drop_last: drop the partial last global batch (the default, and what training wants:
            every step sees the same global batch). With False it is kept and split as evenly as
            the ranks allow; a rank may then get a batch of zero rows.
        prefetch: batches prepared ahead by a background thread; 0 prepares them inline.
        verify_checksums: hash every shard against the manifest on open (reads all the data).
        expected_vocab_sha256: the model's vocabulary hash; a dataset tokenized with another
            vocabulary is refused.
        cache_dir: where remote datasets are copied (default: the temp directory).

    Iterating yields the batches of the current epoch from the current position and stops at
    the end of the epoch; `set_epoch` moves to another. `state_dict()` counts the batches handed
    to the consumer (not those prefetched), so a checkpoint taken mid-epoch resumes exactly.
    """

    def __init__(
        self,
        data_dir: str,
        split: str = "train",
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        max_predictions: int | None = None,
        mask_prob: float = 0.15,
        whole_word: bool = False,
        drop_last: bool = True,
        prefetch: int = 2,
        verify_checksums: bool = False,
        expected_vocab_sha256: str | None = None,
        cache_dir: str | None = None,
    ):
        _check_layout(batch_size, rank, world_size, prefetch, seed)
        local_dir = _local_dataset_dir(data_dir, split, cache_dir)
        manifest, self._rows = _open_split(local_dir, split, verify_checksums)
        if expected_vocab_sha256 is not None and (
            manifest.tokenizer.vocab_sha256 != expected_vocab_sha256
        ):
            raise ValueError(
                f"the vocabulary of {data_dir} (sha256 {manifest.tokenizer.vocab_sha256[:12]}...) "
                f"does not match the model's ({expected_vocab_sha256[:12]}...): the token ids "
                "would mean other words; prepare the data with the model's vocab.txt"
            )
        tokens = _read_vocab_tokens(local_dir, manifest.tokenizer)
        self.manifest = manifest
        self.split = split
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.seed, self.drop_last, self.prefetch = seed, drop_last, prefetch
        self.pad_id = tokens.index("[PAD]")
        self.max_seq_length = _max_seq_length(manifest, max_predictions)
        self.collator = PretrainingCollator(
            MaskingVocab.from_tokens(tokens),
            seed=seed,
            max_predictions=max_predictions
            if max_predictions is not None
            else default_max_predictions(self.max_seq_length, mask_prob),
            mask_prob=mask_prob,
            whole_word=whole_word,
        )
        if len(self) == 0:
            raise ValueError(
                f"split {split!r} of {data_dir} has {self.num_samples} samples, fewer than one "
                f"global batch of {self.global_batch_size} (use drop_last=False for evaluation)"
            )
        self._epoch, self._batches_consumed = 0, 0
        self._live: weakref.ref[_BatchIterator] | None = None

    # -- size and position ----------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self._rows.num_rows

    @property
    def vocab_size(self) -> int:
        return self.collator.vocab.vocab_size

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        return self._batches_consumed

    def __len__(self) -> int:
        """Global batches (= this rank's batches) per epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch` at its first batch; the current epoch keeps its position.

        So a training loop may call `set_epoch(e)` blindly after `load_state_dict`.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._close_live()
            self._epoch, self._batches_consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "batches_consumed": self._batches_consumed,  # global batches into the epoch
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "num_samples": self.num_samples,
            "split": self.split,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; any rank count works if the global batch is the same.

        A state saved at the very end of an epoch resumes at the start of the next one.
        """
        if state.get("version", STATE_VERSION) > STATE_VERSION:
            raise ValueError(f"loader state version {state['version']} is newer than this code")
        for key in ("seed", "global_batch_size", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the saved loader state has {key}={state[key]}, this loader "
                    f"has {getattr(self, key)} (the position would point at other samples)"
                )
        if not 0 <= state["batches_consumed"] <= len(self):
            raise ValueError(f"saved position {state['batches_consumed']} is outside the epoch")
        self._close_live()
        self._epoch, self._batches_consumed = int(state["epoch"]), int(state["batches_consumed"])
        if self._batches_consumed == len(self):
            # Saved at the end of an epoch: what an uninterrupted run does next is the next
            # epoch, and a loop that iterates right after loading must not find nothing.
            self._epoch, self._batches_consumed = self._epoch + 1, 0

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._close_live()  # one live iterator at a time: positions must not interleave
        iterator = _BatchIterator(self, self._epoch, self._batches_consumed)
        self._live = weakref.ref(iterator)
        return iterator

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of sample indices (uint32 when it fits: 4 bytes a sample)."""
        generator = np.random.default_rng([self.seed, epoch])
        dtype = np.uint32 if self.num_samples < 2**32 else np.int64
        # Shuffling arange in place draws exactly what permutation(N) draws, in any dtype.
        return generator.permutation(np.arange(self.num_samples, dtype=dtype))

    def rank_indices(self, order: np.ndarray, global_batch: int) -> np.ndarray:
        """This rank's sample indices in global batch `global_batch` of an epoch order."""
        start = global_batch * self.global_batch_size
        members = order[start : start + self.global_batch_size].astype(np.int64)
        if len(members) == self.global_batch_size:
            return members[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return np.array_split(members, self.world_size)[self.rank]  # the partial last batch

    def make_batch(self, order: np.ndarray, epoch: int, global_batch: int) -> dict[str, Any]:
        """Batch `global_batch` of an epoch, for this rank: gather, pad, mask."""
        rows = self._rows.gather(self.rank_indices(order, global_batch), self.pad_id)
        return self.collator(rows, epoch)

    def _close_live(self) -> None:
        live = self._live() if self._live is not None else None
        if live is not None:
            live.close()
        self._live = None

    def _advance(self, epoch: int, batches_consumed: int) -> None:
        assert epoch == self._epoch, "a closed iterator must not advance the loader"
        self._batches_consumed = batches_consumed


def _check_layout(batch_size: int, rank: int, world_size: int, prefetch: int, seed: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")


def _max_seq_length(manifest: manifest_lib.Manifest, max_predictions: int | None) -> int | None:
    length = manifest.instance_params.get("max_seq_length")
    if length is None and max_predictions is None:
        raise ValueError("the manifest has no max_seq_length: pass max_predictions explicitly")
    return None if length is None else int(length)


class _Failure:
    """An exception raised in the prefetch thread, carried to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


def _produce(
    make_batch: Any,
    order: np.ndarray,
    epoch: int,
    batches: range,
    out: queue.Queue,
    stop: threading.Event,
) -> None:
    """The prefetch thread: prepare batches in order; stop promptly when told."""
    for global_batch in batches:
        try:
            item: Any = make_batch(order, epoch, global_batch)
        except BaseException as error:  # noqa: BLE001 - re-raised in the consumer
            item = _Failure(error)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        if stop.is_set() or isinstance(item, _Failure):
            return


class _BatchIterator:
    """Yields one epoch's batches from a position; advances the loader as it hands them out."""

    def __init__(self, loader: PretrainingLoader, epoch: int, start: int):
        self._closed = False  # first: __del__ runs even if the rest fails
        self._queue: queue.Queue | None = None
        self._loader, self._epoch, self._next = loader, epoch, start
        self._end = len(loader)
        self._order = loader.epoch_order(epoch)
        if loader.prefetch > 0 and start < self._end:
            self._queue = queue.Queue(maxsize=loader.prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=_produce,
                args=(
                    loader.make_batch,
                    self._order,
                    epoch,
                    range(start, self._end),
                    self._queue,
                    self._stop,
                ),
                name="bertforge-prefetch",
                daemon=True,  # never keeps the interpreter alive
            )
            self._thread.start()

    def __iter__(self) -> _BatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._closed or self._next >= self._end:
            self.close()
            raise StopIteration
        if self._queue is None:
            item: Any = self._loader.make_batch(self._order, self._epoch, self._next)
        else:
            item = self._queue.get()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        self._next += 1
        self._loader._advance(self._epoch, self._next)  # counted when handed out
        return item

    def close(self) -> None:
        """Stop the prefetch thread and wait for it; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:
            self._stop.set()
            self._thread.join()

    def __del__(self) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Statistics.


def token_frequencies(data_dir: str, split: str = "train") -> np.ndarray:
    """Occurrences of every vocabulary id over a split (int64[vocab_size]), streaming the shards.

    The baseline of masked-LM accuracy: always guessing the most frequent token.
    """
    local_dir = _local_dataset_dir(data_dir, split, None)
    manifest, rows = _open_split(local_dir, split, verify_checksums=False)
    counts = np.zeros(manifest.tokenizer.vocab_size, dtype=np.int64)
    for token_ids in rows.iter_token_ids():
        if len(token_ids) and int(token_ids.max()) >= len(counts):
            raise ValueError(f"split {split!r} of {data_dir} holds ids past the vocabulary")
        counts += np.bincount(token_ids, minlength=len(counts))
    return counts
