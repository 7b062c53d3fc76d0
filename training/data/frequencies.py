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
    for token_ids in rows.iter_token_ids():
        if len(token_ids) and int(token_ids.max()) >= len(counts):
            raise ValueError(f"split {split!r} of {data_dir} holds ids past the vocabulary")
        counts += np.bincount(token_ids, minlength=len(counts))
    return counts
