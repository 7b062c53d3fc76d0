"""GLUE's metrics and SQuAD v1.1's official exact match / F1, in numpy (no scipy or sklearn).

GLUE metrics are fractions in [0, 1] (accuracy 0.93, not 93), as `sklearn`/`evaluate` return
them; SQuAD's are on the official script's 0-100 scale. Where a statistic is undefined (a constant
prediction), the correlations return 0.0, as sklearn's Matthews correlation does, so a sweep can
still rank runs and results.json stays valid JSON (no NaN).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from bertforge.training.finetune import tasks
from bertforge.training.finetune.tasks import TaskSpec


def _pair(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(predictions), np.asarray(labels)
    if p.ndim != 1 or p.shape != y.shape:
        raise ValueError(f"{p.shape} predictions for {y.shape} labels: give two equal 1-d arrays")
    if p.size == 0:
        raise ValueError("no predictions to score")
    return p, y


def accuracy(predictions, labels) -> float:
    p, y = _pair(predictions, labels)
    return float(np.mean(p == y))


def f1_binary(predictions, labels, positive: int = 1) -> float:
    """F1 of the `positive` class (MRPC: 1 = paraphrase); 0.0 when it is neither predicted nor
    present (sklearn's zero_division=0)."""
    p, y = _pair(predictions, labels)
    true_positive = float(np.sum((p == positive) & (y == positive)))
    predicted, actual = float(np.sum(p == positive)), float(np.sum(y == positive))
    if true_positive == 0:
        return 0.0
    return 2 * true_positive / (predicted + actual)  # = 2PR / (P + R)


def matthews_corrcoef(predictions, labels) -> float:
    """Matthews correlation (CoLA), the multi-class form (Gorodkin 2004) that sklearn uses; for
    two classes it is (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN))."""
    p, y = _pair(predictions, labels)
    classes, index = np.unique(np.concatenate([y, p]), return_inverse=True)
    k = len(classes)
    confusion = np.zeros((k, k), dtype=np.float64)  # rows = label, columns = prediction
    np.add.at(confusion, (index[: y.size], index[y.size :]), 1)
    true_per_class, predicted_per_class = confusion.sum(axis=1), confusion.sum(axis=0)
    correct, total = np.trace(confusion), confusion.sum()
    numerator = correct * total - true_per_class @ predicted_per_class
    denominator = np.sqrt(
        (total**2 - predicted_per_class @ predicted_per_class)
        * (total**2 - true_per_class @ true_per_class)
    )
    return float(numerator / denominator) if denominator > 0 else 0.0


def pearson(predictions, labels) -> float:
    p, y = _pair(predictions, labels)
    p, y = p.astype(np.float64) - np.mean(p), y.astype(np.float64) - np.mean(y)
    denominator = np.sqrt(np.sum(p * p) * np.sum(y * y))
    return float(np.sum(p * y) / denominator) if denominator > 0 else 0.0


def average_ranks(values) -> np.ndarray:
    """1-based ranks; ties share the mean of the ranks they span: [5, 1, 5] -> [2.5, 1, 2.5]."""
    x = np.asarray(values)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts_group = np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]])
    group = np.cumsum(starts_group) - 1
    first = np.flatnonzero(starts_group)  # 0-based position where each group of ties starts
    last = np.concatenate([first[1:], [x.size]]) - 1
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = ((first + last) / 2 + 1)[group]
    return ranks


def spearman(predictions, labels) -> float:
    """Pearson correlation of the average ranks (scipy.stats.spearmanr's definition)."""
    p, y = _pair(predictions, labels)
    return pearson(average_ranks(p), average_ranks(y))


METRIC_FUNCTIONS = {
    tasks.ACCURACY: accuracy,
    tasks.F1: f1_binary,
    tasks.MCC: matthews_corrcoef,
    tasks.PEARSON: pearson,
    tasks.SPEARMAN: spearman,
}


def task_metrics(spec: TaskSpec, predictions, labels) -> dict[str, float]:
    """Every metric of `spec` ({"f1": .., "accuracy": ..} for MRPC): predictions are class ids,
    or floats for a regression."""
    return {name: METRIC_FUNCTIONS[name](predictions, labels) for name in spec.metrics}


def chance_level(spec: TaskSpec, labels) -> dict | None:
    """What always answering the dev set's most frequent label scores on `spec`'s metrics:
    {"label": its id, "metrics": {...}}; None for a regression. The bar a run must clear to
    have learned anything: MRPC's dev set is 68 % paraphrases, so an accuracy of 0.68 there
    is no skill (its tie goes to the smaller id, as numpy's argmax does)."""
    if spec.is_regression:
        return None
    y = np.asarray(labels)
    ids, counts = np.unique(y, return_counts=True)
    if ids.size == 0:
        raise ValueError("no labels to score")
    majority = int(ids[np.argmax(counts)])
    return {"label": majority, "metrics": task_metrics(spec, np.full(y.shape, majority), y)}


def single_label(predictions) -> int | None:
    """The one label every prediction gave (a run that learned nothing), or None."""
    p = np.asarray(predictions)
    return int(p[0]) if p.size and p.ndim == 1 and np.all(p == p[0]) else None


# SQuAD v1.1: the official evaluate-v1.1.py, function for function.


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


_PUNCTUATION = frozenset(string.punctuation)


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-overlap F1 of the normalised answers."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def max_over_ground_truths(metric, prediction: str, ground_truths: Iterable[str]) -> float:
    return max(float(metric(prediction, truth)) for truth in ground_truths)


def squad_evaluate(examples: Sequence, predictions: Mapping[str, str]) -> dict[str, float]:
    """{"exact_match", "f1"} in 0-100 over `examples` (anything with `.id` and `.answers`, e.g.
    squad.SquadExample); a question without a prediction scores 0, as in the official script."""
    if not examples:
        raise ValueError("no SQuAD examples to score")
    exact = f1 = 0.0
    for example in examples:
        if example.id not in predictions:
            continue
        prediction = predictions[example.id]
        exact += max_over_ground_truths(exact_match_score, prediction, example.answers)
        f1 += max_over_ground_truths(f1_score, prediction, example.answers)
    return {"exact_match": 100.0 * exact / len(examples), "f1": 100.0 * f1 / len(examples)}
