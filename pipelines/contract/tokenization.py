"""WordPiece tokenization equal to `transformers.BertTokenizerFast` with the same vocab and casing.

Built directly on `tokenizers` (no transformers import) with the same normalizer, pre-tokenizer
and model settings that BertTokenizerFast uses, so ids match bit for bit.
"""

from __future__ import annotations

import io

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import WordPiece

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
UNKNOWN_TOKEN = "[UNK]"


def read_vocab(vocab_path: str, *, allow_repeats: bool = False) -> dict[str, int]:
    """Google's layout: one token per line, id = line number."""
    with open(vocab_path, "rb") as f:
        return parse_vocab(f.read(), vocab_path, allow_repeats=allow_repeats)


def parse_vocab(vocab_bytes: bytes, name: str = "the vocabulary", *,
                allow_repeats: bool = False) -> dict[str, int]:
    """`read_vocab` on the file's bytes (the preparation job ships the vocabulary as bytes).

    A repeated token is refused: the job's sentence marker takes the id after the last token
    (`pipelines.instances.sentence_ids`), which a repeat makes one a token holds. A model's
    vocabulary from elsewhere (`allow_repeats`, fine-tuning a Hugging Face BERT) is read as
    transformers reads it: the repeat's last line gives its id."""
    # Universal newlines, as reading the file in text mode gives; a BOM (an editor's) is no
    # part of the first token.
    try:
        text = vocab_bytes.decode("utf-8-sig")
    except UnicodeDecodeError as error:  # a compressed or binary file named by mistake
        raise ValueError(f"{name} is not UTF-8 text ({error}): not a vocab.txt") from None
    tokens = [line.rstrip("\n") for line in io.StringIO(text, newline=None)]
    while tokens and tokens[-1] == "":
        tokens.pop()  # a trailing blank line is not a token
    vocab = {token: index for index, token in enumerate(tokens)}
    # First: a file that is no vocabulary at all (a corpus named as --vocab) is said to be so,
    # not listed as thousands of repeated lines.
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"{name} lacks the BERT special tokens {missing}")
    if len(vocab) < len(tokens) and not allow_repeats:
        raise ValueError(f"{name} {_repeated_entries(tokens)}: a token's id is its line, so a "
                         "repeated one leaves a line no text reaches and its id ambiguous; "
                         "remove the repeats")
    if vocab["[PAD]"] != 0 and not allow_repeats:
        # The model pads with id 0 (its padding row, which no gradient reaches: Hugging Face's
        # pad_token_id), so whatever token is there never trained, [UNK] in the `tokenizers`
        # quickstart's order, and an export said its [PAD] was that token.
        raise ValueError(f"{name} has [PAD] on line {vocab['[PAD]'] + 1}: BERT pads with id 0, "
                         f"whose embedding never trains, so [PAD] must be the first line "
                         f"(line 1 holds {tokens[0]!r}); move it there and prepare again")
    return vocab


def _repeated_entries(tokens: list[str]) -> str:
    """"repeats 'the' (lines 1997 and 2001)" for the first few repeated tokens (lines 1-based)."""
    lines: dict[str, list[int]] = {}
    for number, token in enumerate(tokens, start=1):
        lines.setdefault(token, []).append(number)
    repeated = [(token, numbers) for token, numbers in lines.items() if len(numbers) > 1]
    shown = ", ".join(f"{token!r} (lines {_first_lines(numbers)})"
                      for token, numbers in repeated[:3])
    more = f" and {len(repeated) - 3} more" if len(repeated) > 3 else ""
    return f"repeats {shown}{more}"


def _first_lines(numbers: list[int], shown: int = 3) -> str:
    """"2 and 3", or "2, 3, 5 and 480 more" (a blank line repeated all through a file)."""
    if len(numbers) <= shown:
        return " and ".join(map(str, numbers))
    return f"{', '.join(map(str, numbers[:shown]))} and {len(numbers) - shown} more"


def load_tokenizer(vocab_path: str, lower_case: bool) -> Tokenizer:
    """A `tokenizers.Tokenizer` configured like BertTokenizerFast(vocab_path, do_lower_case=...).

    It encodes without special tokens: instance building adds [CLS]/[SEP] itself.
    """
    return tokenizer_from_vocab(read_vocab(vocab_path, allow_repeats=True), lower_case)


def tokenizer_from_vocab(vocab: dict[str, int], lower_case: bool) -> Tokenizer:
    """`load_tokenizer` on a parsed vocabulary."""
    tokenizer = Tokenizer(WordPiece(vocab, unk_token=UNKNOWN_TOKEN, max_input_chars_per_word=100))
    # strip_accents=None means "follow lowercase", exactly as BertTokenizerFast does.
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer
