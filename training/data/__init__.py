"""Pretraining data: memory-mapped Arrow shards in, masked padded batches out.

A prepared dataset (see `pipelines/contract/manifest.py`) holds one row per sentence pair;
the loader yields batches with Hugging Face names (`input_ids`, `token_type_ids`,
`attention_mask`, `labels`, `next_sentence_label`) that `transformers.BertForPreTraining`
accepts unchanged. One module per step of the way:

    download   a remote dataset (gs://, s3://) copied once to a local cache
    shards     one Arrow shard memory-mapped and checked; rows gathered by global index
    split      a split opened against its manifest (row counts, hashes, vocabulary)
    integrity  each record batch checked before its first row is served (ids, lengths, label)
    checksums  each shard's sha256 verified once per process, in a background thread
    rows       the padded, unmasked rows of one batch
    order      the epoch's permutation, optionally bucketed by length
    collate    rows -> masked tensors (dynamic masking per sample and epoch)
    packing    masked rows -> several instances a row (block-diagonal attention), opt-in
    prefetch   a background thread preparing the next batches
    resume     the loader's position as a state dict
    loader     `PretrainingLoader`, which wires them for one rank
    frequencies  token counts of a split (the masked-LM baseline)
"""

from bertforge.training.data.collate import MaskingOptions, PretrainingCollator
from bertforge.training.data.download import download_split
from bertforge.training.data.frequencies import token_frequencies
from bertforge.training.data.loader import PretrainingLoader
from bertforge.training.data.order import BucketingOptions
from bertforge.training.data.packing import PackingOptions
from bertforge.training.data.rows import RowBatch, padded_width, rows_from_sequences
from bertforge.training.data.split import ReadOptions

__all__ = [
    "BucketingOptions",
    "MaskingOptions",
    "PackingOptions",
    "PretrainingCollator",
    "PretrainingLoader",
    "ReadOptions",
    "RowBatch",
    "download_split",
    "padded_width",
    "rows_from_sequences",
    "token_frequencies",
]
