"""Token statistics of a split, streamed from its shards: the baseline of masked-LM accuracy."""

from __future__ import annotations

import numpy as np

from bertforge.training.data.download import local_dataset_dir
from bertforge.training.data.split import open_split_rows

# Rows gathered at a time when counting chosen rows: ~4096 x 512 int64 ids at most, 16 MiB.
_ROWS_AT_A_TIME = 4096


def token_frequencies(data_dir: str, split: str = "train",
                      rows: np.ndarray | None = None) -> np.ndarray:
    """Occurrences of every vocabulary id over a split (int64[vocab_size]), streaming the shards;
    with `rows` (global row indices), over those rows alone, reading only their pages.

    The baseline of masked-LM accuracy: always guessing the most frequent token. `rows`: an
    eval of a few batches of a large split counts what it scores (it streamed the whole split
    first: 2 s for 300,000 rows here, minutes for a Wikipedia-sized one).
    """
    local_dir = local_dataset_dir(data_dir, split, None)
    manifest, shard_rows = open_split_rows(local_dir, split)
    counts = np.zeros(manifest.tokenizer.vocab_size, dtype=np.int64)
    if rows is not None:
        return _rows_frequencies(shard_rows, np.asarray(rows, dtype=np.int64), counts)
    for segment, token_ids in shard_rows.iter_token_ids():
        if len(token_ids) and int(token_ids.max()) >= len(counts):
            raise ValueError(_past_the_vocabulary(segment, token_ids, len(counts), data_dir))
        counts += np.bincount(token_ids, minlength=len(counts))
    return counts


def _rows_frequencies(shard_rows, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`counts` plus the ids of `rows` (their padding left out). An id past the vocabulary is
    not counted here: the loader's row check names its shard and row as the row is served."""
    for start in range(0, len(rows), _ROWS_AT_A_TIME):
        batch = shard_rows.gather(rows[start : start + _ROWS_AT_A_TIME], pad_id=0)
        real = np.arange(batch.input_ids.shape[1]) < batch.lengths[:, None]
        ids = batch.input_ids[real]
        counts += np.bincount(ids[ids < len(counts)], minlength=len(counts))
    return counts


def _past_the_vocabulary(segment, token_ids: np.ndarray, vocab_size: int, data_dir: str) -> str:
    """Which shard and row holds the first id past the vocabulary (a damaged file): it said
    only which split, where `inspect` names the row."""
    at = int(np.flatnonzero(token_ids >= vocab_size)[0])
    row = int(np.searchsorted(segment.offsets, segment.offsets[0] + at, side="right")) - 1
    return (f"shard {segment.path}, row {segment.first_row + row}: token id "
            f"{int(token_ids[at])} is past the vocabulary's {vocab_size} entries (a damaged "
            f"file; `bertforge inspect --verify {data_dir}` checks every file)")
