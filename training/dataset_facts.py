"""What training needs to know of a prepared dataset, read from its manifest in one place.

The maximum sequence length, the vocabulary (size, sha256, lower-casing) and the masking
default that follows from the length are facts of the data, not settings: the loop, evaluation
and the loader take them from a `DatasetFacts`, and a recipe leaves `max_predictions` unset so
that the data decides it (Google's max_predictions_per_seq: 20 at 128 tokens, 80 at 512).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bertforge.pipelines.contract.manifest import Manifest, read_manifest
from bertforge.training.errors import as_user_error
from bertforge.training.masking import default_max_predictions


@dataclass(frozen=True)
class DatasetFacts:
    max_seq_length: int  # [CLS] A [SEP] B [SEP] at most, as the instances were built
    vocab_size: int
    vocab_sha256: str  # of the dataset's vocab.txt: a model must have been trained on the same
    lower_case: bool
    # Instances per split ({"train": n, "validation": m}): the validation's batch size (loop).
    split_sizes: dict[str, int] = field(default_factory=dict, compare=False)
    # The training split's samples in order (`Manifest.split_sha256`): a resume must continue
    # the same ones, as its loader position counts samples of their order.
    train_sha256: str | None = field(default=None, compare=False)

    @classmethod
    def read(cls, data_dir: str) -> DatasetFacts:
        """The facts of a local dataset directory (its `manifest.json`); a missing or
        malformed manifest is a user error (`training.errors`), never retried."""
        try:
            return cls.from_manifest(read_manifest(data_dir), data_dir)
        except (ValueError, FileNotFoundError) as error:
            raise as_user_error(error) from error

    @classmethod
    def from_manifest(cls, manifest: Manifest, data_dir: str = "the dataset") -> DatasetFacts:
        tokenizer = manifest.tokenizer
        return cls(
            max_seq_length=manifest.instance_param("max_seq_length", data_dir),
            vocab_size=tokenizer.vocab_size,
            vocab_sha256=tokenizer.vocab_sha256,
            lower_case=tokenizer.lower_case,
            split_sizes={name: split.num_instances for name, split in manifest.splits.items()},
            train_sha256=manifest.split_sha256("train"),
        )

    def default_max_predictions(self, mask_prob: float = 0.15) -> int:
        """Google's 20 at 128 tokens and 80 at 512 (at mask_prob 0.15); else round(length x p)."""
        return default_max_predictions(self.max_seq_length, mask_prob)
