"""Synthetic pretraining batches shaped like real ones, for throughput benchmarks and smoke runs.

Shapes and statistics, not text: what a step's cost depends on is the padded width, the real
tokens per row and the labelled positions per row, so those follow the real pipeline:

- lengths by the target rule of Google's `create_pretraining_data.py` (our `pipelines/`
  instances): `max_num_tokens = max_seq_length - 3`; with p `short_seq_prob` (0.1) the target
  is uniform on [2, max_num_tokens], else max_num_tokens; a row is `[CLS] A [SEP] B [SEP]`
  with A + B = target tokens and the split uniform on [1, target - 1];
- masking by the loader's own collator (`training.data.collate.PretrainingCollator`): 15 % of the
  tokens, at most Google's 20 (128 tokens) / 80 (512) predictions per row, 80/10/10;
- padding by the loader's own rule: each batch to its longest row, rounded up to 8.

Token ids are uniform over the non-special ids of a bertforge-layout vocabulary ([PAD] 0,
[UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4), NSP labels 50/50. What this leaves out: real data also
has rows cut short where a document ends (a target longer than what is left of it), so real
batches hold fewer real tokens and more padding than these; measure with real shards for that.
"""

from __future__ import annotations

import numpy as np
import torch

from bertforge.training.data import (
    MaskingOptions,
    PretrainingCollator,
    RowBatch,
    rows_from_sequences,
)
from bertforge.training.masking import MaskingVocab, default_max_predictions

# The throughput benchmarks' micro-batch (gpu_throughput.py and its transformers peer): 32,768
# tokens, 256 x 128 and 64 x 512.
TOKENS_PER_MICRO_BATCH = 32_768


def micro_batches(lengths: list[int], given: str | None) -> list[int]:
    """One micro-batch per sequence length: `given` ("64" for all, "256,64" one per length),
    else TOKENS_PER_MICRO_BATCH tokens each."""
    if given is None:
        return [max(1, TOKENS_PER_MICRO_BATCH // n) for n in lengths]
    micro = [int(x) for x in given.split(",")]
    micro = micro * len(lengths) if len(micro) == 1 else micro
    if len(micro) != len(lengths) or min(micro) < 1:
        raise SystemExit(f"--micro-batch: give one value or one per length {lengths}")
    return micro


PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
NUM_SPECIAL = 5
GOOGLE_SHORT_SEQ_PROB = 0.1


def synthetic_masking_vocab(vocab_size: int) -> MaskingVocab:
    """A bertforge-layout vocabulary: five specials first, every other id a plain word."""
    if vocab_size <= NUM_SPECIAL:
        raise ValueError(f"vocab_size must exceed the {NUM_SPECIAL} special tokens")
    return MaskingVocab.from_ids(
        special_ids=range(NUM_SPECIAL), mask_id=MASK_ID, vocab_size=vocab_size,
        random_token_ids=np.arange(NUM_SPECIAL, vocab_size),
    )


def instance_token_counts(
    rng: np.random.Generator, num_rows: int, max_seq_length: int,
    short_seq_prob: float = GOOGLE_SHORT_SEQ_PROB,
) -> np.ndarray:
    """Tokens of A + B per row (no specials): Google's target length rule."""
    max_num_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    if max_num_tokens < 2:
        raise ValueError(f"max_seq_length must be at least 5, got {max_seq_length}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    short = rng.random(num_rows) < short_seq_prob
    short_targets = rng.integers(2, max_num_tokens, size=num_rows, endpoint=True)
    return np.where(short, short_targets, max_num_tokens)


def synthetic_rows(
    rng: np.random.Generator, num_rows: int, max_seq_length: int, vocab_size: int, *,
    short_seq_prob: float = GOOGLE_SHORT_SEQ_PROB, first_index: int = 0,
) -> RowBatch:
    """`[CLS] A [SEP] B [SEP]` rows of random words, padded as the loader pads."""
    sequences, num_a_tokens = [], []
    for num_tokens in instance_token_counts(rng, num_rows, max_seq_length, short_seq_prob):
        len_a = int(rng.integers(1, num_tokens - 1, endpoint=True))
        words = rng.integers(NUM_SPECIAL, vocab_size, size=int(num_tokens))
        sequences.append(np.concatenate(
            [[CLS_ID], words[:len_a], [SEP_ID], words[len_a:], [SEP_ID]]
        ).astype(np.int64))
        num_a_tokens.append(len_a + 2)
    return rows_from_sequences(
        sequences, num_a_tokens, rng.integers(0, 2, size=num_rows),
        np.arange(first_index, first_index + num_rows), PAD_ID,
    )


def synthetic_batches(
    num_batches: int, batch_size: int, max_seq_length: int, vocab_size: int, *,
    seed: int = 0, short_seq_prob: float = GOOGLE_SHORT_SEQ_PROB, mask_prob: float = 0.15,
    max_predictions: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """`num_batches` distinct masked batches with the loader's names and layout."""
    rng = np.random.default_rng([seed, max_seq_length])
    masking = MaskingOptions(
        max_predictions or default_max_predictions(max_seq_length, mask_prob), mask_prob
    )
    collator = PretrainingCollator(synthetic_masking_vocab(vocab_size), masking, seed=seed)
    return [
        collator(synthetic_rows(rng, batch_size, max_seq_length, vocab_size,
                                short_seq_prob=short_seq_prob, first_index=i * batch_size),
                 epoch=0)
        for i in range(num_batches)
    ]
