"""WordPiece vocabulary training with `tokenizers`, written in Google's `vocab.txt` layout.

The trainer is `BertWordPieceTokenizer`'s: the same normalizer (clean text, CJK spacing, accents
stripped exactly when lower-casing) and pre-tokenizer that `pipelines.contract.tokenization` and
`transformers.BertTokenizerFast` use, so the learned pieces are the ones encoding will look up.
"""

from __future__ import annotations

import glob
import logging
import os

from tokenizers.implementations import BertWordPieceTokenizer

from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS
from bertforge.pipelines.read.input_files import iter_texts

logger = logging.getLogger(__name__)

VOCAB_FILE_NAME = "vocab.txt"


def expand_paths(patterns: list[str]) -> list[str]:
    """Local paths and glob patterns -> sorted files; a clear error for a pattern matching none."""
    paths: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matched = [p for p in matched if os.path.isfile(p)]
        if not matched:
            raise ValueError(f"no input file matches {pattern!r}")
        paths += matched
    return paths


def train_wordpiece_vocab(
    text_files: list[str],
    output_dir: str,
    *,
    vocab_size: int = 30522,
    lower_case: bool = True,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
) -> str:
    """Train on corpus files (JSON Lines with `text`, or one sentence per line); return the path.

    `[PAD] [UNK] [CLS] [SEP] [MASK]` get ids 0-4 (Google's uncased file has 0, 100, 101, 102, 103,
    but only the names matter to every consumer here). The corpus is streamed, never loaded whole.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}"
        )
    paths = expand_paths(text_files)
    tokenizer = BertWordPieceTokenizer(lowercase=lower_case, strip_accents=None)
    tokenizer.train_from_iterator(
        iter_texts(paths),
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        limit_alphabet=limit_alphabet,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert tokens[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS), tokens[:10]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, VOCAB_FILE_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(token + "\n" for token in tokens)
    logger.info("vocab: %d tokens from %d files -> %s", len(tokens), len(paths), path)
    return path
