"""The vocabulary job's configuration (`VocabConfig`): `bertforge vocab`'s flags and a pipeline
file's [vocab] keys are generated from its fields, so each option has one declaration and one
spelling (`--vocab-size` / `vocab_size`, `--no-lower-case` / `lower_case = false`)."""

from __future__ import annotations

from dataclasses import dataclass

from bertforge.pipelines.contract.config_fields import NO_FLAG, NOT_IN_FILE, option
from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS


@dataclass(frozen=True)
class VocabConfig:
    """A WordPiece vocabulary to train (`pipelines.vocab.train_wordpiece_vocab`)."""

    # The command places these two itself: first, and required.
    inputs: tuple[str, ...] = option(
        (), "corpus files, directories or globs, each read by prepare's readers (a FORMAT: "
        "prefix too, e.g. books:DIR/*.txt)", flag="--input", marks=(NO_FLAG,))
    output: str = option("", "directory for vocab.txt", marks=(NO_FLAG, NOT_IN_FILE))
    vocab_size: int = option(
        30522, "entries of the vocabulary; fewer (with a warning) when the corpus has no more "
        "pieces worth a token")
    lower_case: bool = option(
        True, "lower-case and strip accents, as an uncased vocabulary needs (bertforge pipeline "
        "prepares with the same casing; a prepare of its own needs --no-lower-case for a "
        "cased one, and warns where the casing looks wrong)")

    def __post_init__(self) -> None:
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, "
                             f"got {self.vocab_size}")
