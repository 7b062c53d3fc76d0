"""training.finetune.metrics against values worked out by hand (no scipy/sklearn in the venv)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bertforge.training.finetune.metrics import (
    accuracy,
    average_ranks,
    chance_level,
    exact_match_score,
    f1_binary,
    f1_score,
    matthews_corrcoef,
    normalize_answer,
    pearson,
    single_label,
    spearman,
    squad_evaluate,
    task_metrics,
)
from bertforge.training.finetune.tasks import custom_task, task_spec

# A confusion matrix with TP = 3, TN = 4, FP = 1, FN = 2 (10 examples, positive class 1).
LABELS = [1, 1, 1, 0, 0, 0, 0, 0, 1, 1]
PREDICTIONS = [1, 1, 1, 0, 0, 0, 0, 1, 0, 0]


def test_accuracy_and_f1_of_a_known_confusion_matrix() -> None:
    assert accuracy(PREDICTIONS, LABELS) == pytest.approx(7 / 10)
    # precision 3/4, recall 3/5: F1 = 2PR/(P+R) = 0.9/1.35 = 2/3
    assert f1_binary(PREDICTIONS, LABELS) == pytest.approx(2 / 3)
    # of class 0: TP 4, FP 2, FN 1 -> 2*4/(6+5)
    assert f1_binary(PREDICTIONS, LABELS, positive=0) == pytest.approx(8 / 11)
    assert f1_binary([0, 0], [0, 0]) == 0.0  # the positive class is nowhere: 0, not a crash


def test_matthews_correlation_of_a_known_confusion_matrix() -> None:
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (12 - 2) / sqrt(4*5*5*6)
    assert matthews_corrcoef(PREDICTIONS, LABELS) == pytest.approx(10 / math.sqrt(600))
    assert matthews_corrcoef(LABELS, LABELS) == pytest.approx(1.0)
    assert matthews_corrcoef([1 - y for y in LABELS], LABELS) == pytest.approx(-1.0)
    assert matthews_corrcoef([1] * 10, LABELS) == 0.0  # constant prediction: defined as 0


def test_matthews_correlation_multiclass() -> None:
    # 3 classes, 4 of 6 right, 2 per class on both sides: (4*6 - 12) / sqrt((36-12)(36-12)) = 0.5
    assert matthews_corrcoef([0, 1, 2, 0, 2, 1], [0, 1, 2, 0, 1, 2]) == pytest.approx(0.5)


def test_pearson_and_spearman_with_ties() -> None:
    x, y = [1, 2, 3, 4, 5], [2, 4, 5, 4, 5]
    # deviations (-2,-1,0,1,2) and (-2,0,1,0,1): 6 / sqrt(10 * 6)
    assert pearson(x, y) == pytest.approx(6 / math.sqrt(60))
    # y's average ranks (1, 2.5, 4.5, 2.5, 4.5): deviations (-2,-.5,1.5,-.5,1.5): 7 / sqrt(10 * 9)
    assert average_ranks(y).tolist() == [1, 2.5, 4.5, 2.5, 4.5]
    assert spearman(x, y) == pytest.approx(7 / math.sqrt(90))
    assert spearman([0.1, 0.2, 9.0], [1, 2, 3]) == pytest.approx(1.0)  # monotone, not linear
    assert pearson([0.1, 0.2, 9.0], [1, 2, 3]) < 0.9
    assert pearson([2.0, 2.0, 2.0], [1, 2, 3]) == 0.0  # constant prediction: 0, not NaN
    assert average_ranks([5, 1, 5]).tolist() == [2.5, 1.0, 2.5]


def test_task_metrics_uses_the_tasks_metrics() -> None:
    assert task_metrics(task_spec("MRPC"), PREDICTIONS, LABELS) == pytest.approx(
        {"f1": 2 / 3, "accuracy": 0.7}
    )
    assert set(task_metrics(task_spec("CoLA"), PREDICTIONS, LABELS)) == {
        "matthews_corrcoef",
        "accuracy",
    }
    assert task_metrics(task_spec("sts-b"), [1, 2, 3, 4, 5], [2, 4, 5, 4, 5]) == pytest.approx(
        {"pearson": 6 / math.sqrt(60), "spearman": 7 / math.sqrt(90)}
    )
    three_way = custom_task(["text"], "label", labels=["a", "b", "c"])
    assert task_metrics(three_way, [0, 1, 2], [0, 1, 1]) == pytest.approx({"accuracy": 2 / 3})


def test_metrics_reject_mismatched_or_empty_input() -> None:
    with pytest.raises(ValueError, match="predictions for"):
        accuracy([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="no predictions"):
        pearson([], [])


@pytest.mark.parametrize(
    "text, normalised",
    [
        ("The  Quick, brown fox!", "quick brown fox"),
        ("an apple a day", "apple day"),
        ("Theater at the Anatomy", "theater at anatomy"),  # whole words only
        ("U.S. $5.00", "us 500"),
        ("  Denver\tBroncos\n", "denver broncos"),
    ],
)
def test_normalize_answer_follows_the_official_script(text, normalised) -> None:
    assert normalize_answer(text) == normalised


def test_squad_em_and_f1_on_known_cases() -> None:
    assert exact_match_score("the Denver Broncos", "Denver Broncos!")
    assert not exact_match_score("Denver Broncos won", "Denver Broncos")
    # tokens (denver, broncos, won) vs (denver, broncos): P 2/3, R 1, F1 0.8
    assert f1_score("Denver Broncos won", "the Denver Broncos") == pytest.approx(0.8)
    assert f1_score("Carolina", "Panthers") == 0.0
    assert f1_score("", "Panthers") == 0.0
    examples = [
        SimpleNamespace(id="q1", answers=["Carolina Panthers", "the Panthers", "Panthers"]),
        SimpleNamespace(id="q2", answers=["Denver Broncos", "Broncos"]),
        SimpleNamespace(id="q3", answers=["Santa Clara"]),
    ]
    # q1: EM via its second/third answer; q2: F1 max(0.8, 2*(1/3)*1/(4/3) = 0.5); q3: unanswered
    predictions = {"q1": "Panthers.", "q2": "Denver Broncos won"}
    result = squad_evaluate(examples, predictions)
    assert result == pytest.approx({"exact_match": 100 / 3, "f1": 100 * 1.8 / 3})
    assert squad_evaluate(examples[:1], {"q1": "the carolina panthers"})["exact_match"] == 100.0


def test_chance_is_the_score_of_always_answering_the_commonest_dev_label() -> None:
    """MRPC's dev set is 68 % paraphrases: accuracy 0.68 there is no skill; F1 of answering
    "paraphrase" always is 0.81 and its Matthews correlation 0."""
    labels = [1] * 68 + [0] * 32
    assert chance_level(task_spec("mrpc"), labels) == {
        "label": 1, "metrics": {"f1": pytest.approx(2 * 68 / (100 + 68)), "accuracy": 0.68}}
    assert chance_level(task_spec("cola"), [0, 0, 1]) == {
        "label": 0, "metrics": {"matthews_corrcoef": 0.0, "accuracy": pytest.approx(2 / 3)}}
    assert chance_level(task_spec("rte"), [1, 0])["label"] == 0  # a tie: the smaller id
    assert chance_level(task_spec("stsb"), [0.5, 4.0]) is None  # a regression has no label


def test_single_label_is_a_run_that_answered_one_label_for_every_example() -> None:
    assert single_label([1, 1, 1]) == 1
    assert single_label([0]) == 0
    assert single_label([1, 0, 1]) is None
    assert single_label([]) is None
