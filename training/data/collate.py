"""Collation: unmasked rows in, masked Hugging Face tensors out.

Masks are dynamic (DESIGN.md, "Determinism"): drawn per (seed, epoch, sample index) at load time,
so every epoch masks a sample anew and the same sample masks the same way in any batch, on any
rank, in any order. The rules themselves are `training.masking`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from bertforge.training.data.rows import RowBatch
from bertforge.training.dataset_facts import DatasetFacts
from bertforge.training.masking import MaskingVocab, SampleStreams, mask_batch


@dataclass(frozen=True)
class MaskingOptions:
    """What is masked (see `training.masking`); the defaults are Google's."""

    # Predictions per sequence at most; None: the dataset's default (20 at 128 tokens, 80 at 512).
    max_predictions: int | None = None
    mask_prob: float = 0.15
    whole_word: bool = False  # the 80/10/10 choice per word, not per piece

    def __post_init__(self) -> None:
        # Of the wrong type they were taken ("no" turned whole-word masking on) or failed at
        # the first batch, inside numpy.
        if not isinstance(self.whole_word, bool):
            raise TypeError(f"whole_word must be True or False, got {self.whole_word!r}")
        if self.max_predictions is not None and (
                isinstance(self.max_predictions, bool)
                or not isinstance(self.max_predictions, (int, np.integer))):
            raise TypeError(f"max_predictions must be an int or None, got "
                            f"{self.max_predictions!r}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ValueError(f"mask_prob must be in (0, 1), got {self.mask_prob}")
        if self.max_predictions is not None and self.max_predictions < 1:
            raise ValueError(f"max_predictions must be >= 1, got {self.max_predictions}")

    def for_dataset(self, facts: DatasetFacts) -> MaskingOptions:
        """These options with max_predictions, when unset, the dataset's default."""
        if self.max_predictions is not None:
            return self
        return replace(self, max_predictions=facts.default_max_predictions(self.mask_prob))


class PretrainingCollator:
    """Masks a `RowBatch` (dynamically: per (seed, epoch, sample index)) into HF tensors."""

    def __init__(self, vocab: MaskingVocab, masking: MaskingOptions, *, seed: int):
        if masking.max_predictions is None:
            raise ValueError("the collator needs max_predictions: take the dataset's default "
                             "with MaskingOptions.for_dataset")
        self.vocab = vocab
        self.masking = masking
        self.seed = seed

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
            max_predictions=self.masking.max_predictions,
            mask_prob=self.masking.mask_prob,
            whole_word=self.masking.whole_word,
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
