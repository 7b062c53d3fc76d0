"""Token statistics of a split, streamed from its shards: the baseline of masked-LM accuracy."""

from __future__ import annotations

import numpy as np

from bertforge.training.data.download import local_dataset_dir
from bertforge.training.data.split import open_split_rows


def token_frequencies(data_dir: str, split: str = "train") -> np.ndarray:
    """Occurrences of every vocabulary id over a split (int64[vocab_size]), streaming the shards.

    The baseline of masked-LM accuracy: always guessing the most frequent token.
    """
    local_dir = local_dataset_dir(data_dir, split, None)
    manifest, rows = open_split_rows(local_dir, split)
    counts = np.zeros(manifest.tokenizer.vocab_size, dtype=np.int64)
    for segment, token_ids in rows.iter_token_ids():
        if len(token_ids) and int(token_ids.max()) >= len(counts):
            raise ValueError(_past_the_vocabulary(segment, token_ids, len(counts), data_dir))
        counts += np.bincount(token_ids, minlength=len(counts))
    return counts


def _past_the_vocabulary(segment, token_ids: np.ndarray, vocab_size: int, data_dir: str) -> str:
    """Which shard and row holds the first id past the vocabulary (a damaged file): it said
    only which split, where `inspect` names the row."""
    at = int(np.flatnonzero(token_ids >= vocab_size)[0])
    row = int(np.searchsorted(segment.offsets, segment.offsets[0] + at, side="right")) - 1
    return (f"shard {segment.path}, row {segment.first_row + row}: token id "
            f"{int(token_ids[at])} is past the vocabulary's {vocab_size} entries (a damaged "
            f"file; `bertforge inspect --verify {data_dir}` checks every file)")
