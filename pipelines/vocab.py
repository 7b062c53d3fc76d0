"""WordPiece vocabulary training with `tokenizers`, written in Google's `vocab.txt` layout.

The trainer is `BertWordPieceTokenizer`'s: the same normalizer (clean text, CJK spacing, accents
stripped exactly when lower-casing) and pre-tokenizer that `pipelines.contract.tokenization` and
`transformers.BertTokenizerFast` use, so the learned pieces are the ones encoding will look up.

The same corpus gives the same vocab.txt byte for byte. `tokenizers` (0.23) alone does not: its
trainer numbers the `##` pieces of single characters in the order it meets them in a hash map
whose seed changes from process to process, and those numbers break ties between merges of equal
count (tokenizers issue #1794), so two runs learned different vocabularies (735 lines of diff on
the demo's corpus) and everything after them differed. We count once without merges to learn
which `##` characters the corpus has, then train with them declared up front, in sorted order
(the trainer's special tokens are numbered as given): the ids, the ties and the merges are then
fixed. The vocabulary holds the same tokens as a lucky run; only their order in the file differs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator

from tokenizers.implementations import BertWordPieceTokenizer

from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS
from bertforge.pipelines.read.input_files import iter_texts
from bertforge.pipelines.read.inputs_transform import match_inputs
from bertforge.pipelines.vocab_options import VocabConfig

logger = logging.getLogger(__name__)

VOCAB_FILE_NAME = "vocab.txt"


def train_wordpiece_vocab(
    config: VocabConfig, *, min_frequency: int = 2, limit_alphabet: int = 1000
) -> str:
    """Train on the corpus files of `config.inputs`; return the path of `config.output`/vocab.txt
    (replaced if there was one).
    The inputs are what `prepare --input` takes: files, directories or globs, with a format
    prefix where wanted (`books:DIR/*.txt`), read by the same readers (JSON Lines, Parquet, wiki
    dumps, books, one sentence per line).

    `[PAD] [UNK] [CLS] [SEP] [MASK]` get ids 0-4 (Google's uncased file has 0, 100, 101, 102, 103,
    but only the names matter to every consumer here). The corpus is streamed, never loaded whole.
    """
    tokens = wordpiece_tokens(config, min_frequency=min_frequency, limit_alphabet=limit_alphabet)
    return write_vocab(tokens, config)


def train_keeping_another(config: VocabConfig, *, overwrite: bool) -> str:
    """`bertforge vocab`: as `train_wordpiece_vocab`, but a vocab.txt already in the output that
    holds other tokens is kept, and the run refused, unless `overwrite`: the datasets prepared
    with it, and the models trained on them, read their ids by it. The same vocabulary again
    (the same corpus and settings: training is deterministic) is left as it is."""
    tokens = wordpiece_tokens(config)
    path = os.path.join(config.output, VOCAB_FILE_NAME)
    if overwrite or not os.path.isfile(path):
        return write_vocab(tokens, config)
    with open(path, "rb") as f:
        existing = f.read()
    if existing == _vocab_bytes(tokens):
        logger.info("vocab: %s already holds this vocabulary (%d tokens): unchanged", path,
                    len(tokens))
        return path
    theirs = existing.decode("utf-8", "replace").splitlines()
    pairs = zip(theirs, tokens, strict=False)  # the shorter's end, where all else agrees
    differ = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(theirs), len(tokens)))
    raise ValueError(
        f"{path} holds another vocabulary than these inputs and settings give ({len(theirs)} "
        f"tokens against {len(tokens)}, first apart at id {differ}): the datasets prepared with "
        "it and the models trained on them read their ids by it; give another --output, or "
        "--overwrite to replace it")


def _refuse_unwritable(output_dir: str) -> None:
    """An output folder this process may not write, found before the training: it trained
    first (minutes on a large corpus), then failed writing vocab.txt.tmp."""
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # the nearest folder that is there: it makes the rest
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output {output_dir}: {existing} is not writable (permission "
                         "denied)")


def wordpiece_tokens(
    config: VocabConfig, *, min_frequency: int = 2, limit_alphabet: int = 1000
) -> list[str]:
    """The vocabulary `train_wordpiece_vocab` writes, in id order, trained and checked."""
    vocab_size, lower_case, output_dir = config.vocab_size, config.lower_case, config.output
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):  # before minutes of reading
        raise ValueError(f"--output {output_dir} is a file; give a directory ({VOCAB_FILE_NAME} "
                         "is written into it)")
    if output_dir.endswith(".txt") and not os.path.isdir(output_dir):
        # A file's name: it would become a directory holding vocab.txt (work/vocab.txt/vocab.txt).
        parent = os.path.dirname(output_dir.rstrip("/")) or "."
        raise ValueError(f"--output {output_dir} names a file; give the directory "
                         f"{VOCAB_FILE_NAME} is written into (e.g. {parent})")
    _refuse_unwritable(output_dir)
    files = match_inputs(config.inputs, output_dir)
    paths, formats = [path for path, _ in files], {path: fmt for path, fmt in files if fmt}
    settings = dict(min_frequency=min_frequency, limit_alphabet=limit_alphabet,
                    show_progress=False)
    # Pass 1, no merges: the alphabet and the `##` characters (a set: the same in every run).
    skipped: Counter = Counter()
    read_from: set[str] = set()
    texts = _counted(iter_texts(paths, formats, skipped, read_from))
    pieces = _train(texts, lower_case, vocab_size=1, special_tokens=list(SPECIAL_TOKENS),
                    **settings)
    _check_read(texts.count, skipped, len(paths))
    continuations = sorted(t for t in pieces if t.startswith(CONTINUATION) and len(t) == 3)
    # Pass 2: those numbered in sorted order, before the trainer meets them.
    vocab = _train(iter_texts(paths, formats), lower_case, vocab_size=vocab_size,
                   special_tokens=list(SPECIAL_TOKENS) + continuations, **settings)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert tokens[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS), tokens[:10]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "ids must be dense"
    # The files that gave text, not those named (the warning above counted what was skipped).
    read = len(read_from)
    logger.info("vocab: %d tokens from %d file%s", len(tokens), read, "" if read == 1 else "s")
    if len(tokens) > vocab_size:  # the special tokens and the alphabet are always kept
        logger.warning(
            "vocab: %d tokens, more than the %d asked for: the special tokens and the corpus's "
            "characters alone take that many (the model's vocabulary is %d)",
            len(tokens), vocab_size, len(tokens))
    if len(tokens) < vocab_size:  # the trainer stops when no pair is left to merge
        logger.warning(
            "vocab: %d tokens, fewer than the %d asked for: the corpus has no more pieces "
            "worth a token (a larger corpus gives more; the model's vocabulary is %d)",
            len(tokens), vocab_size, len(tokens))
    return tokens


def write_vocab(tokens: list[str], config: VocabConfig) -> str:
    """`config.output`/vocab.txt, one token a line in id order, renamed in whole: a
    half-written vocab.txt never exists."""
    os.makedirs(config.output, exist_ok=True)
    path = os.path.join(config.output, VOCAB_FILE_NAME)
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(_vocab_bytes(tokens))
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk: its part would keep the disk full
            os.remove(path + ".tmp")
        raise
    logger.info("vocab: wrote %s", path)
    return path


def _vocab_bytes(tokens: list[str]) -> bytes:
    return "".join(token + "\n" for token in tokens).encode("utf-8")


CONTINUATION = "##"  # WordPiece's prefix of a piece inside a word


def _train(texts: Iterable[str], lower_case: bool, **trainer_settings) -> dict[str, int]:
    """One run of the trainer over the corpus' texts: its vocabulary, token -> id."""
    tokenizer = BertWordPieceTokenizer(lowercase=lower_case, strip_accents=None,
                                       wordpieces_prefix=CONTINUATION)
    tokenizer.train_from_iterator(texts, wordpieces_prefix=CONTINUATION, **trainer_settings)
    return tokenizer.get_vocab()


class _counted:
    """The texts of an iterator, counted as they pass."""

    def __init__(self, texts: Iterator[str]) -> None:
        self._texts, self.count = texts, 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            self.count += 1
            yield text


def _check_read(num_texts: int, skipped: Counter, num_files: int) -> None:
    """What the inputs gave, said: nothing read is an error (a vocabulary of the special
    tokens alone would be written), files or records skipped a warning, by reason."""
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    if not num_texts:
        raise ValueError(f"no text in the {num_files} input file(s)"
                         + (f": skipped {reasons} (as prepare would reject them)" if reasons
                            else ""))
    if skipped:
        logger.warning("vocab: skipped %s, as prepare would reject them", reasons)
