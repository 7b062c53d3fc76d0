"""The trained vocabulary is Google's layout, and our tokenizer equals BertTokenizerFast on it."""

import json
import os
import shutil

import pytest

from bertforge.pipelines.contract.tokenization import SPECIAL_TOKENS, load_tokenizer
from bertforge.pipelines.instances.sentences import split_sentences
from bertforge.pipelines.vocab import train_wordpiece_vocab
from bertforge.pipelines.vocab_options import VocabConfig

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
    path = train_wordpiece_vocab(VocabConfig(
        (docstring_corpus,), str(tmp_path / "v"), vocab_size=2000, lower_case=lower_case
    ))
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
        VocabConfig((str(tmp_path / "*.txt"),), str(tmp_path / "v"), vocab_size=200),
        min_frequency=1)
    with open(path, encoding="utf-8") as f:
        assert "cat" in f.read().splitlines()


def test_a_vocabulary_inside_its_corpus_folder_is_not_read_by_the_next_run(tmp_path):
    """`vocab --input corpus --output corpus/vocab` run again read its own vocab.txt (and log)
    as corpus, and trained another vocabulary."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "books.txt").write_text(
        "The cat sat on the mat.\nThe dog sat too.\n\nA new document starts here.\n" * 50)
    config = VocabConfig((str(tmp_path / "corpus"),), str(tmp_path / "corpus" / "vocab"),
                         vocab_size=200)
    first = open(train_wordpiece_vocab(config, min_frequency=1), encoding="utf-8").read()
    assert open(train_wordpiece_vocab(config, min_frequency=1), encoding="utf-8").read() == first


def test_a_vocabulary_smaller_than_asked_says_so(tmp_path, caplog):
    (tmp_path / "small.txt").write_text("The cat sat on the mat.\nThe dog sat too.\n" * 20)
    with caplog.at_level("WARNING", logger="bertforge"):
        path = train_wordpiece_vocab(
            VocabConfig((str(tmp_path / "small.txt"),), str(tmp_path / "v")), min_frequency=1)
    with open(path, encoding="utf-8") as f:
        size = len(f.read().splitlines())
    assert size < 30522
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"vocab: {size} tokens, fewer than the 30522 asked for: the corpus has no more pieces "
        f"worth a token (a larger corpus gives more; the model's vocabulary is {size})"]


def test_inputs_prepare_would_reject_are_said_and_nothing_read_is_an_error(tmp_path, caplog):
    """A `.jsonl` holding XML and a truncated gzip: skipped as prepare skips them, but said;
    when nothing else is there, no vocabulary of the special tokens alone is written."""
    import gzip

    (tmp_path / "articles.jsonl").write_text("<mediawiki><page></page></mediawiki>\n")
    good = "The cat sat on the mat.\nThe dog sat too.\n" * 200
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(good.encode())[:-30])
    bad = VocabConfig((str(tmp_path / "articles.jsonl"), str(tmp_path / "cut.txt.gz")),
                      str(tmp_path / "v"))
    with pytest.raises(ValueError, match=r"no text in the 2 input file\(s\): skipped 1 "
                                         r"format_mismatch, 1 truncated_compressed_file"):
        train_wordpiece_vocab(bad)
    assert not (tmp_path / "v").exists()
    (tmp_path / "good.txt").write_text(good)
    with caplog.at_level("INFO", logger="bertforge"):
        train_wordpiece_vocab(VocabConfig(bad.inputs + (str(tmp_path / "good.txt"),),
                                          str(tmp_path / "v"), vocab_size=60), min_frequency=1)
    said = [r.getMessage() for r in caplog.records]
    assert ("vocab: skipped 1 format_mismatch, 1 truncated_compressed_file, as prepare would "
            "reject them") in said
    # The one file read, not the 3 named.
    assert any(line.endswith(" tokens from 1 file") for line in said), said


def test_a_vocabulary_larger_than_asked_says_so(tmp_path, caplog):
    """Fewer entries than the corpus has characters: the alphabet is kept whole, and said."""
    (tmp_path / "small.txt").write_text("The cat sat on the mat.\nThe dog sat too.\n" * 20)
    with caplog.at_level("WARNING", logger="bertforge"):
        path = train_wordpiece_vocab(
            VocabConfig((str(tmp_path / "small.txt"),), str(tmp_path / "v"), vocab_size=10),
            min_frequency=1)
    with open(path, encoding="utf-8") as f:
        size = len(f.read().splitlines())
    assert size > 10
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"vocab: {size} tokens, more than the 10 asked for: the special tokens and the corpus's "
        f"characters alone take that many (the model's vocabulary is {size})"]


def test_bertforge_vocab_keeps_another_vocabulary_unless_told_to_replace_it(tmp_path):
    """`bertforge vocab` over a vocab.txt of other tokens replaced it without a word, and with
    it the ids of every dataset prepared and model trained with it. Now it is refused (exit 2)
    and kept; the same vocabulary again is left as it is; --overwrite replaces it."""
    import subprocess
    import sys

    cats, dogs = tmp_path / "cats.txt", tmp_path / "dogs.txt"
    cats.write_text("The cat sat on the mat.\nA cat naps.\n" * 20, encoding="utf-8")
    dogs.write_text("Dogs bark at the postman.\nDogs run.\n" * 20, encoding="utf-8")
    out = tmp_path / "vocab"

    def vocab(corpus, *flags) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(os.path.dirname(sys.executable), "bertforge"),
                               "vocab", "--input", str(corpus), "--output", str(out),
                               "--vocab-size", "60", *flags],
                              capture_output=True, text=True, timeout=120)

    assert vocab(cats).returncode == 0
    made = (out / "vocab.txt").read_bytes()
    again = vocab(cats)
    assert again.returncode == 0 and "already holds this vocabulary" in again.stderr + again.stdout
    assert (out / "vocab.txt").read_bytes() == made
    refused = vocab(dogs)
    assert refused.returncode == 2, refused.stderr
    assert (f"{out}/vocab.txt holds another vocabulary than these inputs and settings give"
            in refused.stderr) and "--overwrite to replace it" in refused.stderr
    assert (out / "vocab.txt").read_bytes() == made
    assert sorted(os.listdir(out)) == ["logs", "vocab.txt"]  # nothing half-made beside it
    assert vocab(dogs, "--overwrite").returncode == 0
    assert (out / "vocab.txt").read_bytes() != made


def test_every_input_is_read_however_the_flag_lists_them(tmp_path):
    """`vocab --input A --input B` read B alone (the last flag won), where prepare reads both;
    a comma-separated list matched no file. Now each form reads both, as prepare's does."""
    import subprocess
    import sys

    (tmp_path / "a.txt").write_text("Alpha apples arrive.\nAlpha again.\n" * 10, "utf-8")
    (tmp_path / "b.txt").write_text("Beta bananas bounce.\nBeta again.\n" * 10, "utf-8")
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    for number, inputs in enumerate((["--input", a, "--input", b], ["--input", a, b],
                                     ["--input", f"{a},{b}"])):
        out = tmp_path / f"v{number}"
        done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "bertforge"),
                               "vocab", *inputs, "--output", str(out), "--vocab-size", "80"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        tokens = (out / "vocab.txt").read_text("utf-8").split()
        assert {"alpha", "beta"} <= set(tokens), (inputs, tokens)
        assert "tokens from 2 files" in done.stderr, done.stderr


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="matches no file"):
        train_wordpiece_vocab(VocabConfig((str(tmp_path / "nothing-*.jsonl"),),
                                          str(tmp_path / "v")))


def test_an_output_that_is_a_file_is_a_clear_error(tmp_path):
    """`--output work/vocab/vocab.txt` (the file, not its directory) was os.makedirs'
    FileExistsError traceback, after the whole corpus had been read twice."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("One sentence here.\nAnother one there.\n", encoding="utf-8")
    existing = tmp_path / "vocab.txt"
    existing.write_text("[PAD]\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--output .*vocab.txt is a file; give a directory"):
        train_wordpiece_vocab(VocabConfig((str(corpus),), str(existing)))
    assert existing.read_text(encoding="utf-8") == "[PAD]\n"
    # A file's name that does not exist yet became a directory named vocab.txt.
    work = tmp_path / "work"
    with pytest.raises(ValueError, match=rf"--output {work}/vocab.txt names a file; give the "
                                         rf"directory vocab.txt is written into \(e.g. {work}\)"):
        train_wordpiece_vocab(VocabConfig((str(corpus),), str(work / "vocab.txt")))
    assert not (tmp_path / "work").exists()


# Words whose pieces tie in count: the merges the trainer picks among them depend on how it
# numbers the `##` characters, which `tokenizers` alone does in a per-process hash order.
TIED_CORPUS = " ".join(f"{a}{b}{c}" for a in "bdfhk" for b in "aeiou" for c in "lmnrst") + "\n"

TRAIN_IN_A_FRESH_PROCESS = """
import hashlib, sys
from bertforge.pipelines.vocab import train_wordpiece_vocab
from bertforge.pipelines.vocab_options import VocabConfig
path = train_wordpiece_vocab(VocabConfig((sys.argv[1],), sys.argv[2], vocab_size=120),
                             min_frequency=1)
print(hashlib.sha256(open(path, "rb").read()).hexdigest())
"""


def test_the_same_corpus_gives_the_same_vocab_file_in_every_process(tmp_path):
    import subprocess
    import sys

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TIED_CORPUS * 3, encoding="utf-8")
    digests = {
        subprocess.run([sys.executable, "-c", TRAIN_IN_A_FRESH_PROCESS, str(corpus),
                        str(tmp_path / f"vocab{run}")], capture_output=True, text=True,
                       check=True).stdout
        for run in range(6)
    }
    assert len(digests) == 1  # tokenizers alone: 6 vocabularies in 6 runs of this corpus
    tokens = (tmp_path / "vocab0" / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert len(tokens) == len(set(tokens)) == 120 and tokens[:5] == list(SPECIAL_TOKENS)
    # Every `##` character the corpus has, in sorted order right after the special tokens.
    assert tokens[5:16] == [f"##{c}" for c in "aeilmnorstu"]


def test_inputs_are_read_as_prepare_reads_them_books_prefix_included(tmp_path):
    """`vocab --input books:DIR/*.txt` as `prepare` takes it (a book: paragraphs on blank
    lines, wrapped lines joined), and a dangling link among the inputs is named."""
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("Zyxwv qrstu zyxwv qrstu.\r\n\r\nZyxwv again.\r\n" * 20,
                                 encoding="utf-8")
    path = train_wordpiece_vocab(
        VocabConfig((f"books:{books}/*.txt",), str(tmp_path / "v"), vocab_size=60),
        min_frequency=1)
    tokens = open(path, encoding="utf-8").read().split()
    assert "zyxwv" in tokens and "qrstu" in tokens
    os.symlink(tmp_path / "gone.txt", books / "b.txt")
    with pytest.raises(ValueError, match="b.txt is a symbolic link to a missing file"):
        train_wordpiece_vocab(VocabConfig((f"books:{books}/*.txt",), str(tmp_path / "v2")))
