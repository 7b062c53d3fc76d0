"""training.finetune.squad: the official JSON read and split, windows equal to BertTokenizerFast's
overflow, gold spans that map back to the gold text, post-processing back to answers."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from bertforge.pipelines.contract.tokenization import load_tokenizer, read_vocab
from bertforge.training.finetune.features import MODEL_INPUTS
from bertforge.training.finetune.metrics import normalize_answer, squad_evaluate
from bertforge.training.finetune.squad import (
    NOT_CONTEXT,
    SquadExample,
    postprocess_predictions,
    read_squad,
    split_squad,
    squad_features,
    window_starts,
)

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
SQUAD_DEV = os.path.join(SHARED_DATA, "squad", "dev-v1.1.json")
GOOGLE_VOCAB = os.path.join(SHARED_DATA, "bert-base-uncased-vocab.txt")
needs_squad = pytest.mark.skipif(
    not (os.path.isfile(SQUAD_DEV) and os.path.isfile(GOOGLE_VOCAB)),
    reason="../shared/data/squad/dev-v1.1.json or bert-base-uncased-vocab.txt is absent",
)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "who", "won", "the", "game", "?", "."]
WORDS += [
    "denver",
    "broncos",
    "beat",
    "carolina",
    "panthers",
    "in",
    "santa",
    "clara",
    "on",
    "sunday",
]


@pytest.fixture(scope="module")
def squad_examples() -> list[SquadExample]:
    return read_squad(SQUAD_DEV)


@pytest.fixture(scope="module")
def google_tokenizer():
    return load_tokenizer(GOOGLE_VOCAB, True)


@pytest.fixture(scope="module")
def every_fourth(squad_examples) -> list[SquadExample]:
    return squad_examples[::4]  # 2,643 questions of all 48 articles


@pytest.fixture(scope="module")
def short_windows(every_fourth, google_tokenizer) -> dict[str, torch.Tensor]:
    """Training features in windows of 96 overlapping by 24: most examples span several."""
    return squad_features(google_tokenizer, every_fourth, 96, 24, 32, training=True)


def write_json(tmp_path, value) -> str:
    path = tmp_path / "squad.json"
    path.write_text(value if isinstance(value, str) else json.dumps(value), encoding="utf-8")
    return str(path)


def squad_json(qas: list[dict], context: str = "Denver beat Carolina.", title: str = "t") -> dict:
    paragraph = {"context": context, "qas": qas}
    return {"version": "1.1", "data": [{"title": title, "paragraphs": [paragraph]}]}


def question(qid: str = "q1", text: str = "Denver", start: int = 0) -> dict:
    return {"id": qid, "question": "Who won?", "answers": [{"text": text, "answer_start": start}]}


@needs_squad
def test_reads_the_official_dev_file(squad_examples) -> None:
    assert len(squad_examples) == 10_570
    assert len({e.title for e in squad_examples}) == 48
    assert squad_examples[0].title == "Super_Bowl_50"
    assert sum(len(e.answers) for e in squad_examples) == 34_726
    first = squad_examples[0]
    assert first.answers[0] == "Denver Broncos"
    assert first.context[first.answer_starts[0] :].startswith("Denver Broncos")


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"data": [', r"squad\.json, line 1 column 11: not JSON"),
        ({"version": "1.1"}, r"squad\.json: the file has no 'data'"),
        ({"data": []}, r"squad\.json: no questions"),
        (squad_json([{"id": "q1", "question": "?"}]), r"question 'q1' has no 'answers'"),
        (squad_json([question(start=3)]), r"question 'q1': answer 'Denver' is not at character 3"),
        (squad_json([question(), question()]), r"question id 'q1' appears twice"),
        (squad_json([{**question(), "answers": []}]), r"question 'q1' has no answers"),
        (squad_json([question(start="0")]), r"question 'q1': 'answer_start' is a str, not int"),
        # SQuAD v2.0's file was "has no answers" at its first unanswerable question.
        (squad_json([question(), {**question("q2"), "answers": [], "is_impossible": True}]),
         r"question 'q2' is unanswerable \(is_impossible: SQuAD v2\.0's format\); --task squad"
         r" reads SQuAD v1\.1"),
    ],
    ids=[
        "not-json",
        "no-data",
        "empty",
        "no-answers-key",
        "misplaced-answer",
        "same-id",
        "empty-answers",
        "bad-type",
        "squad-v2",
    ],
)
def test_bad_squad_files_give_one_clear_error(tmp_path, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        read_squad(write_json(tmp_path, value))


def test_a_squad_file_in_another_encoding_is_named_with_its_line(tmp_path) -> None:
    """Latin-1 where UTF-8 is due: the file and line, as the GLUE reader says it."""
    path = tmp_path / "latin1.json"
    text = json.dumps(squad_json([question()], context="Denver beat Carolina."), indent=1)
    path.write_bytes(text.replace("Carolina", "Caf\u00e9").encode("latin-1"))
    line = text[: text.index("Carolina")].count("\n") + 1
    with pytest.raises(ValueError, match=rf"latin1\.json, line {line}: not UTF-8 text"):
        read_squad(str(path))
    # UTF-8 with a BOM (as Windows editors save it) reads as without.
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert [e.id for e in read_squad(str(path))] == ["q1"]


def test_split_is_by_article_and_deterministic() -> None:
    examples = [
        SquadExample(f"{t}-{i}", "q", "c", ["a"], [0], title=f"article{t}")
        for t in range(10)
        for i in range(3)
    ]
    train, dev = split_squad(examples, dev_fraction=0.2, seed=0)
    assert len({e.title for e in dev}) == 2 and len(train) + len(dev) == 30
    assert not {e.title for e in dev} & {e.title for e in train}
    assert [e.id for e in train] == [e.id for e in examples if e in train]  # file order kept
    assert split_squad(examples, 0.2, seed=0) == (train, dev)
    assert {e.title for e in split_squad(examples, 0.2, seed=1)[1]} != {e.title for e in dev}
    with pytest.raises(ValueError, match="between 0 and 1"):
        split_squad(examples, dev_fraction=1.0)
    with pytest.raises(ValueError, match="at least two articles"):
        split_squad(examples[:3], dev_fraction=0.5)


@needs_squad
def test_split_of_the_dev_file(squad_examples) -> None:
    train, dev = split_squad(squad_examples, dev_fraction=0.2, seed=0)
    assert len({e.title for e in dev}) == 10 and len({e.title for e in train}) == 38
    assert len(train) + len(dev) == 10_570


def test_window_starts_follow_the_overflow_rule() -> None:
    # 10 tokens, windows of 4 overlapping by 1: [0, 4), [3, 7), [6, 10)
    assert window_starts(10, 4, 1) == [0, 3, 6]
    assert window_starts(11, 4, 1) == [0, 3, 6, 9]
    assert window_starts(4, 4, 1) == [0] and window_starts(0, 4, 1) == [0]


@needs_squad
def test_windows_equal_bert_tokenizer_fast_overflow(squad_examples, google_tokenizer) -> None:
    # Short windows, so most examples span several; questions within the limit (HF cuts none).
    length, stride, max_query = 96, 24, 32
    examples = [e for e in squad_examples[::25] if len(google_tokenizer.encode(e.question)) <= 30]
    ours = squad_features(google_tokenizer, examples, length, stride, max_query)
    hf = transformers.BertTokenizerFast(vocab=read_vocab(GOOGLE_VOCAB), do_lower_case=True)
    theirs = hf(
        [e.question.lstrip() for e in examples], [e.context for e in examples],
        truncation="only_second", max_length=length, stride=stride, padding="max_length",
        return_overflowing_tokens=True, return_offsets_mapping=True,
    )  # fmt: skip
    assert len(ours["input_ids"]) > 2 * len(examples)  # windows were exercised
    for name in MODEL_INPUTS:
        assert ours[name].tolist() == theirs[name], name
    assert ours["example_index"].tolist() == theirs["overflow_to_sample_mapping"]
    for row, offsets in enumerate(theirs["offset_mapping"]):
        context = [i for i, s in enumerate(theirs.sequence_ids(row)) if s == 1]
        expected = torch.full((length, 2), NOT_CONTEXT)
        expected[context] = torch.tensor([offsets[i] for i in context])
        assert torch.equal(ours["offset_mapping"][row], expected)


def mapped_back(examples, features) -> tuple[int, int, set[int]]:
    """(labelled windows whose span reads back as the gold text, labelled windows, examples with
    one), after the official normalisation."""
    exact = labelled = 0
    examples_with_label = set()
    starts, ends = features["start_positions"].tolist(), features["end_positions"].tolist()
    for row, index in enumerate(features["example_index"].tolist()):
        if starts[row] == 0:
            assert ends[row] == 0  # [CLS] for both, or neither
            continue
        example, offsets = examples[index], features["offset_mapping"][row]
        assert 0 < starts[row] <= ends[row] and offsets[starts[row], 0] >= 0
        text = example.context[offsets[starts[row], 0] : offsets[ends[row], 1]]
        exact += normalize_answer(text) == normalize_answer(example.answers[0])
        labelled += 1
        examples_with_label.add(index)
    return exact, labelled, examples_with_label


@needs_squad
@pytest.mark.parametrize("length", [384, 96])
def test_gold_spans_map_back_to_the_gold_text(
    every_fourth, google_tokenizer, short_windows, length
):
    examples = every_fourth
    features = (
        short_windows if length == 96
        else squad_features(google_tokenizer, examples, 384, 128, 64, training=True)
    )  # fmt: skip
    exact, labelled, with_label = mapped_back(examples, features)
    # The misses are answers that are part of a token ("18" of "1878"): run_qa has them too.
    print(f"{length}: {exact}/{labelled} = {exact / labelled:.4f} of gold spans exact")
    assert exact / labelled > 0.99
    # Every answer is whole in some window (windows overlap by more than an answer's length) ...
    assert len(with_label) == len(examples)
    if length == 96:  # ... and short windows label [CLS] where the answer is not in them
        assert (features["start_positions"] == 0).sum() > len(features["start_positions"]) // 3


@needs_squad
def test_postprocess_of_peaks_on_the_gold_spans_gives_the_gold_answers(
    every_fourth, short_windows
) -> None:
    examples, features = every_fourth, short_windows
    start_logits, end_logits = torch.randn(2, *features["input_ids"].shape)  # noise elsewhere
    rows = torch.arange(len(start_logits))
    labelled = features["start_positions"] > 0
    start_logits[rows[labelled], features["start_positions"][labelled]] = 20.0
    end_logits[rows[labelled], features["end_positions"][labelled]] = 20.0
    predictions = postprocess_predictions(examples, features, start_logits, end_logits)
    assert set(predictions) == {e.id for e in examples}
    exact, _, with_label = mapped_back(examples, features)
    answerable = [examples[i] for i in sorted(with_label)]
    result = squad_evaluate(answerable, predictions)
    print(f"EM {result['exact_match']:.2f} F1 {result['f1']:.2f} on {len(answerable)} questions")
    assert result["exact_match"] > 99.0
    exact_ones = [e for e in answerable if normalize_answer(predictions[e.id])
                  == normalize_answer(e.answers[0])]  # fmt: skip
    assert squad_evaluate(exact_ones, predictions) == {"exact_match": 100.0, "f1": 100.0}


def tiny_features(tmp_path, context: str, max_seq_length: int, doc_stride: int):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n", encoding="utf-8")
    example = SquadExample("q", "who won ?", context, ["Denver"], [context.index("Denver")])
    tokenizer = load_tokenizer(str(vocab), True)
    return [example], squad_features(tokenizer, [example], max_seq_length, doc_stride, 4)


def test_postprocess_rules(tmp_path) -> None:
    # [CLS] who won ? [SEP] denver broncos beat carolina panthers in santa clara . [SEP] [PAD]
    context = "Denver Broncos beat Carolina Panthers in Santa Clara."
    examples, features = tiny_features(tmp_path, context, 16, 2)
    assert len(features["input_ids"]) == 1

    def answer(start_peaks: dict, end_peaks: dict, **options) -> str:
        start, end = torch.full((1, 16), -10.0), torch.full((1, 16), -10.0)
        start[0, list(start_peaks)] = torch.tensor(list(start_peaks.values()))
        end[0, list(end_peaks)] = torch.tensor(list(end_peaks.values()))
        ours = postprocess_predictions(examples, features, start, end, **options)["q"]
        assert postprocess_predictions(  # numpy logits, as a loop gathers them, give the same
            examples, features, start.numpy(), end.numpy(), **options
        ) == {"q": ours}
        return ours

    # The question, [CLS] and padding are never part of an answer, whatever their logits.
    assert answer({1: 100.0, 0: 100.0, 5: 5.0}, {2: 100.0, 15: 100.0, 6: 4.0}) == "Denver Broncos"
    # The n_best are those of all positions, as run_squad.py's: a question token among them
    # takes a candidate's place (here the only one's), it is not skipped for the next.
    assert answer({1: 100.0, 5: 5.0}, {6: 4.0}, n_best=1) == "empty"  # run_squad.py's word
    assert answer({1: 100.0, 5: 5.0}, {6: 4.0}, n_best=2) == "Denver Broncos"
    # An end before its start is refused: the best valid span starts at 7 or ends at 5.
    reversed_peaks = answer({7: 50.0}, {5: 50.0})
    assert reversed_peaks.startswith("beat") or reversed_peaks.endswith("Denver")
    assert answer({7: 50.0}, {5: 50.0}, n_best=1) == "empty"  # no valid pair among the top 1
    # A span longer than max_answer_length is refused.
    assert answer({5: 10.0, 11: 3.0}, {13: 10.0, 12: 3.0}) == context
    assert answer({5: 10.0, 11: 3.0}, {13: 10.0, 12: 3.0}, max_answer_length=2) == "Santa Clara"


def test_best_span_over_windows_and_answer_outside_a_window(tmp_path) -> None:
    context = "Santa Clara on Sunday: Denver beat Carolina in Santa Clara on Sunday."
    examples, features = tiny_features(tmp_path, context, 14, 3)
    # 14 context tokens (":" is [UNK]); a 3-token question leaves windows of 14 - 3 - 3 = 8,
    # overlapping by 3: context tokens [0, 8), [5, 13), [10, 14), each after 5 head tokens.
    assert features["example_index"].tolist() == [0, 0, 0]
    start, end = torch.zeros(2, 3, 14)
    start[:, 5], end[:, 6] = 1.0, 1.0  # the first two context tokens of each window
    start[2, 5], end[2, 7] = 9.0, 9.0  # the highest pair, in the last window: context tokens 10-12
    # ... but token 10 is that window's first: run_squad.py takes a start there only from the
    # window where it has the most context, the second (5 tokens left, 2 right). The last
    # window's best left is "Sunday" (token 12, its most-context window; logits 0 + 9).
    assert features["max_context"][2, 5:9].tolist() == [False, False, True, True]
    assert postprocess_predictions(examples, features, start, end) == {"q": "Sunday"}
    start[1, 10], end[1, 12] = 5.0, 5.0  # tokens 10-12 in the second window score 10 > 9
    assert postprocess_predictions(examples, features, start, end) == {"q": "Clara on Sunday"}
    tokenizer = load_tokenizer(str(tmp_path / "vocab.txt"), True)
    train = squad_features(tokenizer, examples, 14, 3, 4, training=True)
    # "Denver" is context token 5: at 5 + 5 in the first window, 0 + 5 in the second, not in
    # the third, which is labelled [CLS].
    assert train["start_positions"].tolist() == [10, 5, 0]
    assert train["end_positions"].tolist() == [10, 5, 0]


def test_features_refuse_a_window_no_longer_than_the_stride(tmp_path) -> None:
    with pytest.raises(ValueError, match="more than doc_stride 128"):
        tiny_features(tmp_path, "Denver", 135, 128)  # 135 - 4 - 3 = 128 context tokens
