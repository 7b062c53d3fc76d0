"""The pretraining loader: memory-mapped Arrow shards in, masked padded batches out.

A prepared dataset (see `pipelines/manifest.py`) holds one row per sentence pair. This module
opens a split, checks it against its manifest, and yields batches with Hugging Face names
(`input_ids`, `token_type_ids`, `attention_mask`, `labels`, `next_sentence_label`) that
`transformers.BertForPreTraining` accepts unchanged.

Order and masks are functions of (seed, epoch, global sample index) only (DESIGN,
"Determinism"): the order of an epoch is a permutation from a Generator seeded with
(seed, epoch); global batch g is `order[g * G:(g + 1) * G]` with G = batch_size x world_size,
and rank r takes the r-th slice of it. So the sequence of global batches is the same for any
number of ranks with the same global batch, and the loader's position, counted in samples of
the epoch, resumes exactly, even on another number of ranks, and even with another global
batch when gradient accumulation keeps the samples per optimizer step (micro x accumulation x
world) the same.

Optional length bucketing reorders the permutation without breaking any of that: windows of
`bucket_window` optimizer-step batches are stable-sorted by length bin, cut back into step
batches, and those are shuffled within the window by the same (seed, epoch) Generator (see
`bucket_order`). The order depends on the step batch, never on how it is split over ranks and
micro-batches.

Memory stays flat in the dataset size: shards are memory-mapped (a row is one seek away) and a
batch gathers only its own rows; the O(N) structures are the epoch's order, 4 bytes a sample,
and with bucketing the row lengths, 2 bytes a sample.
"""

from __future__ import annotations

import hashlib
import json
import math
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

from bertforge.pipelines import manifest as manifest_lib
from bertforge.pipelines.tokenization import read_vocab
from bertforge.training.masking import (
    MaskingVocab,
    SampleStreams,
    default_max_predictions,
    mask_batch,
)

PAD_MULTIPLE = 8  # tensor cores want sequence lengths in multiples of 8
STATE_VERSION = 2  # 2: position in samples, step batch, bucketing
DEFAULT_BUCKET_WINDOW = 64  # step batches sorted together (see bucket_order)
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

    def row_lengths(self) -> np.ndarray:
        """Tokens of every row in global order, from the list offsets alone (no token reads)."""
        parts = [np.diff(segment.offsets) for segment in self._segments]
        lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        # uint16 holds any BERT length (<= 512): 2 bytes a sample, kept for the loader's life.
        return lengths.astype(np.uint16 if lengths.max(initial=0) < 2**16 else np.int64)

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


def _local_dataset_dir(
    data_dir: str,
    split: str,
    cache_dir: str | None,
    filesystem: pafs.FileSystem | None = None,
) -> str:
    """`data_dir` itself when local; else a local copy of its manifest, vocab and split.

    `filesystem` (with `data_dir` a path in it) replaces resolving a URI: for stores that need
    options a URI cannot carry (credentials, an S3 endpoint, a sub-tree).
    """
    if filesystem is None:
        if "://" not in data_dir:
            return data_dir
        filesystem, data_dir = pafs.FileSystem.from_uri(data_dir)
    if isinstance(filesystem, pafs.LocalFileSystem):
        return data_dir
    return download_split(filesystem, data_dir, split, cache_dir)


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
# Order: the epoch's permutation, optionally bucketed by length.


def bucket_bins(lengths: np.ndarray, boundaries: Sequence[int] | np.ndarray) -> np.ndarray:
    """Bin i holds lengths in (boundaries[i-1], boundaries[i]]: its rows pad to its top edge."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), lengths, side="left")


def bucket_order(
    order: np.ndarray,
    lengths: np.ndarray,
    boundaries: Sequence[int],
    step_batch_size: int,
    window: int,
    generator: np.random.Generator,
) -> np.ndarray:
    """Length bucketing of an epoch order: LDDL's length bins, applied at load time.

    The full step batches at the head of `order` go in windows of `window` step batches; each
    window is stable-sorted by length bin, cut back into step batches, and those are shuffled
    within the window by `generator` (so the epoch does not run short-to-long every window).
    The tail, fewer samples than a step batch, stays as it was: what drop_last drops is random,
    not the longest rows. Every sample keeps exactly one place, and the result depends on the
    step batch only, never on how ranks and micro-batches split it.
    """
    bucketed = order.copy()
    full = len(order) // step_batch_size * step_batch_size
    span = window * step_batch_size
    for start in range(0, full, span):  # window by window: temporaries stay O(window)
        part = order[start : min(start + span, full)]
        by_bin = part[np.argsort(bucket_bins(lengths[part], boundaries), kind="stable")]
        steps = by_bin.reshape(-1, step_batch_size)
        bucketed[start : start + len(part)] = steps[generator.permutation(len(steps))].ravel()
    return bucketed


def even_bucket_boundaries(max_seq_length: int, num_buckets: int) -> tuple[int, ...]:
    """Edges of `num_buckets` equal-width bins up to max_seq_length, each a multiple of 8.

    128 tokens in 4 bins: (32, 64, 96), so rows pad to at most 32, 64, 96 or 128.
    """
    edges = {padded_width(-(-max_seq_length * i // num_buckets)) for i in range(1, num_buckets)}
    return tuple(sorted(edge for edge in edges if edge < max_seq_length))


def _resolve_buckets(
    boundaries: Sequence[int] | None,
    num_buckets: int | None,
    window: int,
    max_seq_length: int | None,
) -> tuple[int, ...] | None:
    """The bin edges the options ask for (None: no bucketing), checked."""
    if boundaries is not None and num_buckets is not None:
        raise ValueError("pass bucket_boundaries or num_buckets, not both")
    if window < 1:
        raise ValueError(f"bucket_window must be >= 1 (step batches), got {window}")
    if num_buckets is not None:
        if num_buckets < 2:
            raise ValueError(f"num_buckets must be >= 2, got {num_buckets}")
        if max_seq_length is None:
            raise ValueError("num_buckets needs max_seq_length in the manifest; pass boundaries")
        boundaries = even_bucket_boundaries(max_seq_length, num_buckets)
    if boundaries is None:
        return None
    edges = tuple(int(edge) for edge in boundaries)
    if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(
            f"bucket_boundaries must be positive and strictly increasing, got {boundaries}"
        )
    return edges


# ---------------------------------------------------------------------------------------------
# The loader.


class PretrainingLoader:
    """Batches of one split for one rank, resumable to the exact batch.

    Args:
        data_dir: a prepared dataset: a local path, or a `pyarrow.fs` URI (`gs://...`), which is
            copied once to `cache_dir` and memory-mapped from there.
        split: "train" or "validation".
        batch_size: per rank (the micro-batch); the global batch is `batch_size x world_size`.
        seed: order and masks derive from it (with the epoch and sample index).
        rank, world_size: this worker's slice of every global batch.
        max_predictions: per sequence; default Google's (20 at 128 tokens, 80 at 512).
        mask_prob, whole_word: masking rules (see `training.masking`).
        drop_last: end the epoch at the last full optimizer step (the default, and what
            training wants: every step sees the same number of samples). With False every
            sample is served, the partial last global batch split as evenly as the ranks allow;
            a rank may then get a batch of zero rows.
        gradient_accumulation_steps: loader batches the training loop takes per optimizer step.
            The step batch (batch_size x world_size x accumulation) is the unit of the epoch's
            end and of bucketing, so layouts with the same step batch see the same samples.
        bucket_boundaries: length-bin edges (e.g. (32, 64, 96)) for length bucketing: batches
            then hold rows of similar length, so less padding; None (default) turns it off.
        num_buckets: instead of the edges, that many equal-width bins up to max_seq_length.
        bucket_window: optimizer-step batches sorted together by bin; more means less padding
            and batches less mixed in length.
        prefetch: batches prepared ahead by a background thread; 0 prepares them inline.
        verify_checksums: hash every shard against the manifest on open (reads all the data).
        expected_vocab_sha256: the model's vocabulary hash; a dataset tokenized with another
            vocabulary is refused.
        cache_dir: where remote datasets are copied (default: the temp directory).
        filesystem: a `pyarrow.fs.FileSystem` that `data_dir` is a path in, instead of a URI
            (for stores that need credentials or an endpoint a URI cannot carry).

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
        gradient_accumulation_steps: int = 1,
        bucket_boundaries: Sequence[int] | None = None,
        num_buckets: int | None = None,
        bucket_window: int = DEFAULT_BUCKET_WINDOW,
        prefetch: int = 2,
        verify_checksums: bool = False,
        expected_vocab_sha256: str | None = None,
        cache_dir: str | None = None,
        filesystem: pafs.FileSystem | None = None,
    ):
        _check_layout(batch_size, rank, world_size, gradient_accumulation_steps, prefetch, seed)
        local_dir = _local_dataset_dir(data_dir, split, cache_dir, filesystem)
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
        self.gradient_accumulation_steps = gradient_accumulation_steps
        # 32 micro x 8 ranks x 4 accumulation = 1,024 samples an optimizer step.
        self.step_batch_size = self.global_batch_size * gradient_accumulation_steps
        self.seed, self.drop_last, self.prefetch = seed, drop_last, prefetch
        self.pad_id = tokens.index("[PAD]")
        self.max_seq_length = _max_seq_length(manifest, max_predictions)
        self.bucket_boundaries = _resolve_buckets(
            bucket_boundaries, num_buckets, bucket_window, self.max_seq_length
        )
        self.bucket_window = bucket_window
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
                f"optimizer step ({batch_size} micro x {world_size} ranks x "
                f"{gradient_accumulation_steps} accumulation = {self.step_batch_size}); use "
                "drop_last=False for evaluation"
            )
        # Read once, before any prefetch thread: the bins of every epoch come from them.
        self._lengths = self._rows.row_lengths() if self.bucket_boundaries else None
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

    @property
    def samples_consumed(self) -> int:
        """Samples of the epoch's order handed out so far, over all ranks: the position."""
        return min(self._batches_consumed * self.global_batch_size, self.num_samples)

    def __len__(self) -> int:
        """Global batches (= this rank's batches) per epoch.

        With drop_last the epoch stops after its last full optimizer step: no step straddles
        two epochs, and every layout of the same step batch drops the same N mod step samples.
        """
        if self.drop_last:
            return self.num_samples // self.step_batch_size * self.gradient_accumulation_steps
        return -(-self.num_samples // self.global_batch_size)

    def sample_lengths(self) -> np.ndarray:
        """Tokens of every sample of the split, by global index (from the shard offsets)."""
        if self._lengths is None:
            self._lengths = self._rows.row_lengths()
        return self._lengths

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
            "samples_consumed": self.samples_consumed,  # the position, free of the layout
            "batches_consumed": self._batches_consumed,  # in this loader's global batches
            "epoch_finished": self._batches_consumed == len(self),
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "step_batch_size": self.step_batch_size,
            "num_samples": self.num_samples,
            "split": self.split,
            "bucket_boundaries": _as_list(self.bucket_boundaries),
            "bucket_window": self.bucket_window,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position.

        The position counts samples of the epoch's order, so any layout resumes it whose global
        batch divides it: another number of ranks, or the same optimizer step split otherwise
        between micro-batches and accumulation (2 ranks x accumulation 1 -> 1 rank x 2).
        A state saved at the very end of an epoch resumes at the start of the next one.
        """
        state = _upgrade_state(state)
        self._check_same_order(state)
        epoch, samples = int(state["epoch"]), int(state["samples_consumed"])
        if not 0 <= samples <= self.num_samples:
            raise ValueError(f"saved position {samples} is outside the epoch of {self.num_samples}")
        if state["epoch_finished"] or samples >= len(self) * self.global_batch_size:
            # Nothing of the epoch left for this layout: an uninterrupted run goes on with the
            # next epoch, and a loop that iterates right after loading must not find nothing.
            epoch, samples = epoch + 1, 0
        if samples % self.global_batch_size:
            raise ValueError(self._boundary_error(samples, epoch, state["global_batch_size"]))
        self._close_live()
        self._epoch, self._batches_consumed = epoch, samples // self.global_batch_size

    def _check_same_order(self, state: dict[str, Any]) -> None:
        """Refuse a state whose position would point at other samples in this loader's order."""
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: the saved loader state has {key}={state[key]}, this loader "
                    f"has {getattr(self, key)} (the position would point at other samples)"
                )
        saved = _bucketing(state["bucket_boundaries"], state["bucket_window"])
        mine = _bucketing(self.bucket_boundaries, self.bucket_window)
        if saved != mine:
            raise ValueError(
                f"cannot resume: the saved loader state has length bucketing (boundaries, window) "
                f"{saved}, this loader {mine}: the epoch's order would differ"
            )
        if mine is not None and state["step_batch_size"] != self.step_batch_size:
            raise ValueError(
                f"cannot resume: length bucketing cuts the order in optimizer steps of "
                f"{state['step_batch_size']} samples (saved), this loader's step is "
                f"{self.step_batch_size} ({self.batch_size} x {self.world_size} ranks x "
                f"{self.gradient_accumulation_steps} accumulation): keep micro-batch x ranks x "
                "gradient_accumulation_steps the same"
            )

    def _boundary_error(self, samples: int, epoch: int, saved_global_batch: int) -> str:
        every = self.global_batch_size // math.gcd(self.global_batch_size, saved_global_batch)
        return (
            f"cannot resume after {samples} samples of epoch {epoch} with a global batch of "
            f"{self.global_batch_size} ({self.batch_size} x {self.world_size} ranks): a loader "
            f"resumes only at multiples of its global batch. With this layout, resume from a "
            f"state saved after a multiple of {self.global_batch_size} samples (every {every} "
            f"batches of the saving layout, whose global batch was {saved_global_batch}), or "
            f"pick batch_size x world_size dividing {samples}"
        )

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._close_live()  # one live iterator at a time: positions must not interleave
        iterator = _BatchIterator(self, self._epoch, self._batches_consumed)
        self._live = weakref.ref(iterator)
        return iterator

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's order of sample indices (uint32 when it fits: 4 bytes a sample)."""
        generator = np.random.default_rng([self.seed, epoch])
        dtype = np.uint32 if self.num_samples < 2**32 else np.int64
        # Shuffling arange in place draws exactly what permutation(N) draws, in any dtype.
        order = generator.permutation(np.arange(self.num_samples, dtype=dtype))
        if self.bucket_boundaries is None:
            return order
        # The same generator goes on to shuffle step batches: still (seed, epoch) only.
        return bucket_order(
            order,
            self.sample_lengths(),
            self.bucket_boundaries,
            self.step_batch_size,
            self.bucket_window,
            generator,
        )

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


def _as_list(values: Sequence[int] | None) -> list[int] | None:
    return None if values is None else list(values)


def _bucketing(boundaries: Sequence[int] | None, window: int) -> tuple | None:
    """What of the bucketing options shapes the order (the window counts only with bins)."""
    return None if boundaries is None else (tuple(boundaries), window)


def _upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """A saved state in the current layout; version 1 counted global batches only."""
    version = state.get("version", STATE_VERSION)
    if version > STATE_VERSION:
        raise ValueError(f"loader state version {version} is newer than this code")
    if version >= 2:
        return state
    batches, global_batch = int(state["batches_consumed"]), int(state["global_batch_size"])
    return {
        **state,
        "samples_consumed": min(batches * global_batch, int(state["num_samples"])),
        # Version 1 trained with drop_last and no accumulation: its epoch had N // G batches.
        "epoch_finished": batches == int(state["num_samples"]) // global_batch,
        "step_batch_size": global_batch,
        "bucket_boundaries": None,
        "bucket_window": DEFAULT_BUCKET_WINDOW,
    }


def _check_layout(
    batch_size: int, rank: int, world_size: int, accumulation: int, prefetch: int, seed: int
) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
    if accumulation < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {accumulation}")
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
