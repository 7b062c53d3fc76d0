"""The trained vocabulary is Google's layout, and our tokenizer equals BertTokenizerFast on it."""

import json
import shutil

import pytest

from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS, load_tokenizer
from bertforge.pipelines.instances.sentences import split_sentences
from bertforge.pipelines.vocab import train_wordpiece_vocab

from .conftest import shared_data_file

transformers = pytest.importorskip("transformers")

# Sentences outside a docstring corpus: accents, CJK, control characters, long words, digits.
EXTRA_SENTENCES = [
    "Ünïcode façade: naïve résumé — Åre, São Paulo and Kraków.",
    "東京 is Tokyo; 北京 is Beijing.",
    "Tabs\tand\u00a0non-breaking\u200b spaces, a bell \x07 character.",
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 4 + " is longer than 100 characters.",
    "In 1969, 3.14159 and 1,000,000 (one million) were numbers; e-mail: someone@example.org!",
]


def _sentences(corpus_path: str, limit: int = 400) -> list[str]:
    sentences = []
    with open(corpus_path, encoding="utf-8") as f:
        for line in f:
            sentences += split_sentences(json.loads(line)["text"])
            if len(sentences) >= limit:
                break
    return sentences[:limit] + EXTRA_SENTENCES


def _hf_tokenizer(vocab_path: str, lower_case: bool, tmp_path):
    """BertTokenizerFast from a directory holding `vocab.txt`.

    transformers 5 ignores `vocab_file=` silently (a 5-token vocabulary results); the directory
    form works in 4.x and 5.x alike. The length check guards against that pitfall.
    """
    directory = tmp_path / f"hf-{lower_case}"
    directory.mkdir()
    shutil.copy(vocab_path, directory / "vocab.txt")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(
        str(directory), do_lower_case=lower_case
    )
    with open(vocab_path, encoding="utf-8") as f:
        assert len(tokenizer) == len(f.read().splitlines())
    return tokenizer


def _assert_same_ids(vocab_path: str, lower_case: bool, sentences: list[str], tmp_path) -> None:
    ours = load_tokenizer(vocab_path, lower_case)
    theirs = _hf_tokenizer(vocab_path, lower_case, tmp_path)
    expected = theirs(sentences, add_special_tokens=False)["input_ids"]
    got = [e.ids for e in ours.encode_batch(sentences, add_special_tokens=False)]
    assert got == expected
    assert sum(map(len, got)) > 5 * len(sentences)


@pytest.mark.parametrize("lower_case", [True, False])
def test_trained_vocab_matches_bert_tokenizer_fast(docstring_corpus, tmp_path, lower_case):
    path = train_wordpiece_vocab(
        [docstring_corpus], str(tmp_path / "v"), vocab_size=2000, lower_case=lower_case
    )
    with open(path, encoding="utf-8") as f:
        tokens = f.read().splitlines()
    assert tokens[:5] == list(SPECIAL_TOKENS)
    assert len(tokens) <= 2000 and len(set(tokens)) == len(tokens)
    assert any(t.startswith("##") for t in tokens)
    assert lower_case == (not any(t.isupper() for t in tokens if t not in SPECIAL_TOKENS))
    _assert_same_ids(path, lower_case, _sentences(docstring_corpus), tmp_path)


def test_google_uncased_vocab_matches_bert_tokenizer_fast(docstring_corpus, tmp_path):
    vocab = shared_data_file("bert-base-uncased-vocab.txt")
    _assert_same_ids(str(vocab), True, _sentences(docstring_corpus), tmp_path)


def test_trains_on_sentence_per_line_text(tmp_path):
    corpus = tmp_path / "books.txt"
    corpus.write_text(
        "The cat sat on the mat.\nThe dog sat too.\n\nA new document starts here.\n" * 50
    )
    path = train_wordpiece_vocab(
        [str(tmp_path / "*.txt")], str(tmp_path / "v"), vocab_size=200, min_frequency=1
    )
    with open(path, encoding="utf-8") as f:
        assert "cat" in f.read().splitlines()


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no input file matches"):
        train_wordpiece_vocab([str(tmp_path / "nothing-*.jsonl")], str(tmp_path / "v"))
