"""training.finetune tasks, glue_data and features: GLUE's files read as they are, bad lines named,
tokens equal to transformers.BertTokenizerFast."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import transformers

from bertforge.pipelines.contract.tokenization import load_tokenizer, read_vocab
from bertforge.training.finetune.features import MODEL_INPUTS, encode_examples, encode_texts
from bertforge.training.finetune.glue_data import Example, read_examples, read_label_set
from bertforge.training.finetune.tasks import (
    GLUE_TASKS,
    available_glue_tasks,
    custom_task,
    glue_dir_files,
    task_spec,
)

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
GLUE_DIR = os.path.join(SHARED_DATA, "glue")
GOOGLE_VOCAB = os.path.join(SHARED_DATA, "bert-base-uncased-vocab.txt")
needs_glue = pytest.mark.skipif(
    not os.path.isdir(GLUE_DIR), reason="../shared/data/glue (the real GLUE files) is absent"
)
needs_google_vocab = pytest.mark.skipif(
    not (os.path.isdir(GLUE_DIR) and os.path.isfile(GOOGLE_VOCAB)),
    reason="../shared/data/glue or bert-base-uncased-vocab.txt is absent",
)

# (train rows, dev rows, dev label counts by label id) from DOWNSTREAM-SOURCES.md's table.
GLUE_FACTS = {
    "sst2": (67_349, 872, {0: 428, 1: 444}),
    "cola": (8_551, 1_043, {1: 721, 0: 322}),
    "mrpc": (3_668, 408, {1: 279, 0: 129}),
    "rte": (2_490, 277, {0: 146, 1: 131}),  # 0 = entailment
    "stsb": (5_749, 1_500, None),
}

FIXTURE_VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
    "the", "cat", "sat", "on", "mat", "dog", "ran", "a", "house", "in", "\"", "'",
    ".", ",", "!", "un", "##believ", "##able", "##s", "##ed", "play", "café", "The",
]  # fmt: skip


SST2 = GLUE_TASKS["sst2"]


def write(path, text: str) -> str:
    path.write_bytes(text.encode("utf-8"))
    return str(path)


@pytest.mark.parametrize("spelling", ["SST-2", "sst-2", "sst2", "Sst_2"])
def test_task_spec_accepts_the_usual_spellings(spelling) -> None:
    assert task_spec(spelling) is GLUE_TASKS["sst2"]


def test_task_spec_refuses_an_unknown_task_and_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="sst2, cola, mrpc, rte, stsb"):
        task_spec("mnli")


def test_custom_task_parses_command_line_columns() -> None:
    spec = custom_task(["0", "sentence"], "3", labels=["neg", "pos"])
    assert spec.text_columns == (0, "sentence") and spec.label_column == 3
    assert spec.metrics == ("accuracy", "f1") and spec.num_labels == 2
    assert custom_task(["s"], "score").is_regression
    with pytest.raises(ValueError, match="0-based index"):
        custom_task(["sentence"], 1, labels=["0", "1"], has_header=False)
    with pytest.raises(ValueError, match="one or two text columns"):
        custom_task([0, 1, 2], 3, labels=["0", "1"])


@needs_glue
@pytest.mark.parametrize("name", list(GLUE_FACTS))
def test_reads_every_glue_file_with_the_published_counts(name) -> None:
    spec = GLUE_TASKS[name]
    train_path, dev_path = glue_dir_files(GLUE_DIR, spec)
    num_train, num_dev, dev_counts = GLUE_FACTS[name]
    train, dev = read_examples(train_path, spec), read_examples(dev_path, spec)
    assert (len(train), len(dev)) == (num_train, num_dev)
    assert (dev[0].line, dev[-1].line) == ((1, num_dev) if name == "cola" else (2, num_dev + 1))
    assert all((e.text_b is not None) == (len(spec.text_columns) == 2) for e in train)
    if dev_counts is not None:
        assert Counter(e.label for e in dev) == dev_counts
    else:
        assert all(isinstance(e.label, float) and 0 <= e.label <= 5 for e in dev)
    assert name in available_glue_tasks(GLUE_DIR)


@needs_glue
def test_quotes_and_the_bom_are_read_literally() -> None:
    train = read_examples(glue_dir_files(GLUE_DIR, GLUE_TASKS["mrpc"])[0], GLUE_TASKS["mrpc"])
    assert train[0].text_a == (
        'Amrozi accused his brother, whom he called "the witness", of deliberately distorting'
        " his evidence."
    )
    assert sum('"' in e.text_a + e.text_b for e in train) == 769  # as DOWNSTREAM-SOURCES says


def test_a_quote_that_never_closes_does_not_join_lines(tmp_path) -> None:
    path = write(
        tmp_path / "q.tsv",
        'sentence\tlabel\n"an opening quote only\t1\nnext "line" \'here\t0\r\n\t1\n\n\n',
    )
    examples = read_examples(path, task_spec("sst2"))
    assert examples == [
        Example('"an opening quote only', None, 1, 2),
        Example('next "line" \'here', None, 0, 3),  # a CRLF ending is dropped too
        Example("", None, 1, 4),
    ]


def test_text_with_a_line_separator_character_stays_one_line(tmp_path) -> None:
    path = write(tmp_path / "u.tsv", "sentence\tlabel\nbefore\u2028after\u0085end\t1\n")
    assert [e.text_a for e in read_examples(path, task_spec("sst2"))] == [
        "before\u2028after\u0085end"
    ]


@pytest.mark.parametrize(
    "content, spec, message",
    [
        ("", GLUE_TASKS["sst2"], r"e\.tsv, line 1: the file is empty"),
        ("\n\n", GLUE_TASKS["sst2"], r"e\.tsv, line 1: the file is empty"),
        ("sentence\tlabel\n", GLUE_TASKS["sst2"], r"e\.tsv, line 2: no examples"),
        ("text\tlabel\nfine\t1\n", GLUE_TASKS["sst2"], r"e\.tsv, line 1: no column 'sentence'"),
        ("a\tb\n", GLUE_TASKS["cola"], r"e\.tsv, line 1: no column (3|1).*2 fields"),
        ("sentence\tlabel\ngood\t1\nbad\t2\n", SST2, r"e\.tsv, line 3: unknown label '2'"),
        ("sentence\tlabel\ngood\t1\nbad\t0\textra\n", SST2, r"e\.tsv, line 3: 3 tab-sep"),
        ("sentence\tlabel\ngood\t1\n\nbad\t0\n", GLUE_TASKS["sst2"], r"e\.tsv, line 3: 1 tab-sep"),
        ("sentence\tlabel\nno tab here\n", GLUE_TASKS["sst2"], r"e\.tsv, line 2: 1 tab-sep"),
        (
            "index\tsentence1\tsentence2\tscore\n0\ta\tb\t4.5\n1\tc\td\tfive\n",
            custom_task(["sentence1", "sentence2"], "score"),
            r"e\.tsv, line 3: label 'five' is not a finite number",
        ),
        (
            "index\tsentence1\tsentence2\tscore\n0\ta\tb\t5.000\n1\tc\td\t0\n2\te\tf\t7\n",
            GLUE_TASKS["stsb"],
            r"e\.tsv, line 4: score '7' is outside task stsb's 0-5",
        ),
    ],
    ids=["empty", "blank", "header-only", "missing-column", "missing-index", "unknown-label",
         "too-many-fields", "blank-line-inside", "too-few-fields", "bad-score",
         "score-off-scale"],
)  # fmt: skip
def test_bad_input_gives_one_error_naming_file_and_line(tmp_path, content, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        read_examples(write(tmp_path / "e.tsv", content), spec)


def test_glue_dir_files_names_a_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"SST-2/train\.tsv: no such file"):
        glue_dir_files(str(tmp_path), task_spec("sst2"))
    with pytest.raises(ValueError, match="--train/--dev"):
        glue_dir_files(str(tmp_path), custom_task(["s"], "l", labels=["x", "y"]))
    assert available_glue_tasks(str(tmp_path)) == []


def test_read_label_set_of_a_custom_file(tmp_path) -> None:
    path = write(tmp_path / "l.tsv", "s\tl\na\t10\nb\t2\nc\t10\n")
    spec = custom_task(["s"], "l", labels=["x", "y"])  # the labels are not used to list them
    assert read_label_set(path, spec) == ("2", "10")
    spec = custom_task(["s"], "l", labels=read_label_set(path, spec))
    assert [e.label for e in read_examples(path, spec)] == [1, 0, 1]
    # Signed integers in numeric order too: +1, the positive class, is the last (F1's).
    signed = write(tmp_path / "pm.tsv", "s\tl\na\t+1\nb\t-1\nc\t+1\n")
    assert read_label_set(signed, spec) == ("-1", "+1")
    # A label left out is an error naming its line, not a third class.
    empty = write(tmp_path / "e.tsv", "s\tl\na\t1\nb\t\nc\t0\n")
    with pytest.raises(ValueError, match=r"e\.tsv, line 3: the label is empty"):
        read_label_set(empty, spec)
    # Scores without --regression trained a classifier of a class per distinct score.
    scores = write(tmp_path / "sc.tsv", "s\tl\na\t3.8\nb\t0.25\nc\t4\nd\t3.8\n")
    with pytest.raises(ValueError, match=r"sc\.tsv: the label column holds scores such as "
                       r"0\.25, 3\.8 \(3 distinct values\), not classes: give --regression"):
        read_label_set(scores, spec)
    assert read_label_set(write(tmp_path / "f.tsv", "s\tl\na\t1.0\nb\t0.0\n"),
                          spec) == ("0.0", "1.0")  # whole numbers name classes


def test_a_file_without_a_header_read_with_one_is_refused_not_cut(tmp_path) -> None:
    """Columns given by index and the default header: the first example was dropped as the
    header without a word."""
    lines = "a fine film\t1\na dull one\t0\nfine\t1\n"
    path = write(tmp_path / "n.tsv", lines)
    spec = custom_task(["0"], "1", labels=("0", "1"))
    with pytest.raises(ValueError, match=r"n\.tsv, line 1: read as a header \(the default\), "
                       r"but its label '1' is one of the task's labels: a data line\? Give "
                       "--no-has-header"):
        read_examples(path, spec)
    with pytest.raises(ValueError, match="line 1: read as a header"):
        read_examples(path, custom_task(["0"], "1"))  # a score, for a regression
    headless = custom_task(["0"], "1", labels=("0", "1"), has_header=False)
    assert len(read_examples(path, headless)) == 3
    # A header, by index or by name: read as one.
    named = write(tmp_path / "h.tsv", "sentence\tlabel\n" + lines)
    assert len(read_examples(named, spec)) == 3
    assert len(read_examples(named, custom_task(["sentence"], "label", ("0", "1")))) == 3


def hf_tokenizer(vocab_path: str, lower_case: bool) -> transformers.BertTokenizerFast:
    """transformers builds its own WordPiece from the vocabulary (transformers 5's `vocab=`)."""
    return transformers.BertTokenizerFast(vocab=read_vocab(vocab_path), do_lower_case=lower_case)


def assert_same_as_hf(vocab_path, lower_case, texts_a, texts_b, max_seq_length) -> None:
    ours = encode_texts(load_tokenizer(vocab_path, lower_case), texts_a, texts_b, max_seq_length)
    theirs = hf_tokenizer(vocab_path, lower_case)(
        texts_a, texts_b, truncation=True, max_length=max_seq_length, padding="max_length"
    )
    for name in MODEL_INPUTS:
        assert ours[name].dtype == torch.int64
        assert ours[name].tolist() == theirs[name], name


@pytest.mark.parametrize("max_seq_length", [4, 5, 8, 9, 16, 64])
@pytest.mark.parametrize("lower_case", [True, False])
def test_pairs_match_bert_tokenizer_fast_on_a_fixture_vocab(tmp_path, max_seq_length, lower_case):
    vocab_path = write(tmp_path / "vocab.txt", "\n".join(FIXTURE_VOCAB) + "\n")
    words = ["the", "cats", "played", "on", "a", "mat", "unbelievable", "Café", "!", "zebra"]
    # every split of lengths around the budget, so each branch of longest_first is taken
    texts_a = [" ".join(words[: 1 + i % 10]) for i in range(40)]
    texts_b = [" ".join(words[(i * 3) % 10 :] + words[: i % 7]) for i in range(40)]
    texts_b[3] = 'the "[SEP]" [MASK] cat'  # special tokens inside a text stay whole, as in HF
    assert_same_as_hf(vocab_path, lower_case, texts_a, texts_b, max_seq_length)
    assert_same_as_hf(vocab_path, lower_case, texts_a, None, max_seq_length)


@needs_google_vocab
@pytest.mark.parametrize("name", list(GLUE_TASKS))
@pytest.mark.parametrize("max_seq_length", [128, 25])
def test_real_glue_lines_match_bert_tokenizer_fast(name, max_seq_length) -> None:
    spec = GLUE_TASKS[name]
    examples = read_examples(glue_dir_files(GLUE_DIR, spec)[0], spec)[:300]
    pairs = len(spec.text_columns) == 2
    texts_b = [e.text_b for e in examples] if pairs else None
    assert_same_as_hf(GOOGLE_VOCAB, True, [e.text_a for e in examples], texts_b, max_seq_length)


def test_encode_examples_shapes_and_label_types(tmp_path) -> None:
    vocab_path = write(tmp_path / "vocab.txt", "\n".join(FIXTURE_VOCAB) + "\n")
    tokenizer = load_tokenizer(vocab_path, True)
    pairs = [Example("the cat", "a dog ran", 1, 2), Example("on", "the mat", 0, 3)]
    batch = encode_examples(tokenizer, pairs, 10)
    words = ("[CLS]", "[SEP]", "the", "cat", "a", "dog", "ran")
    cls, sep, the, cat, a, dog, ran = (FIXTURE_VOCAB.index(t) for t in words)
    assert batch["input_ids"][0].tolist() == [cls, the, cat, sep, a, dog, ran, sep, 0, 0]
    assert batch["token_type_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert batch["attention_mask"][0].tolist() == [1] * 8 + [0, 0]
    assert batch["labels"].tolist() == [1, 0] and batch["labels"].dtype == torch.int64
    scores = encode_examples(tokenizer, [Example("the", "cat", 4.25, 2)], 10)["labels"]
    assert scores.dtype == torch.float32 and scores.tolist() == [4.25]
    assert encode_examples(tokenizer, [], 10)["input_ids"].shape == (0, 10)
    with pytest.raises(ValueError, match="at least 4"):
        encode_examples(tokenizer, pairs, 3)


def test_min_train_words_keeps_the_longer_examples_then_the_fixed_subset(tmp_path) -> None:
    from bertforge.training.finetune.config import FinetuneConfig
    from bertforge.training.finetune.task_data import train_examples

    train = write(tmp_path / "train.tsv", "sentence\tlabel\n" + "".join(
        f"{' '.join(['word'] * (1 + i % 12))}\t{i % 2}\n" for i in range(60)))
    spec = task_spec("sst2")

    def config(**fields) -> FinetuneConfig:
        return FinetuneConfig(task="sst2", model="m", output="o", train=train, dev=train,
                              **fields)

    kept = train_examples(config(min_train_words=10), spec)
    assert [len(e.text_a.split()) for e in kept] == [10, 11, 12] * 5  # file order, all of them
    subset = train_examples(config(min_train_words=10, max_train_examples=4), spec)
    assert len(subset) == 4 and {e.line for e in subset} < {e.line for e in kept}
    assert train_examples(config(), spec) == read_examples(train, spec)
    with pytest.raises(ValueError, match="no training example has 13 words or more"):
        train_examples(config(min_train_words=13), spec)
    with pytest.raises(ValueError, match="not squad"):
        FinetuneConfig(task="squad", model="m", output="o", min_train_words=5)
