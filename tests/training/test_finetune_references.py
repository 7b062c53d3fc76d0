"""Fine-tuning's numbers against the references users compare them with: SQuAD's official
`evaluate-v1.1.py`, Google's `run_squad.py` n-best post-processing, and plain implementations of
GLUE's metrics, on the real dev files in ../shared/data and on hand-made edge cases.

The reference functions below are copied from the public scripts (only their Python 2 idioms
updated), not rewritten from bertforge's: a difference is a number that differs from a
published one."""

from __future__ import annotations

import bisect
import collections
import json
import math
import os
import re
import string

import numpy as np
import pytest
import torch

from bertforge.training.finetune import metrics
from bertforge.training.finetune.glue_data import read_examples
from bertforge.training.finetune.squad import postprocess_predictions, read_squad, squad_features
from bertforge.training.finetune.tasks import task_spec

SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")
SQUAD_DEV = os.path.join(SHARED_DATA, "squad", "dev-v1.1.json")
GOOGLE_VOCAB = os.path.join(SHARED_DATA, "bert-base-uncased-vocab.txt")
GLUE_DIR = os.path.join(SHARED_DATA, "glue")
needs_squad = pytest.mark.skipif(
    not (os.path.isfile(SQUAD_DEV) and os.path.isfile(GOOGLE_VOCAB)),
    reason="../shared/data/squad/dev-v1.1.json or bert-base-uncased-vocab.txt is absent",
)


# --- SQuAD's evaluate-v1.1.py (https://rajpurkar.github.io/SQuAD-explorer/), verbatim ---------


def official_normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def official_f1_score(prediction, ground_truth):
    prediction_tokens = official_normalize_answer(prediction).split()
    ground_truth_tokens = official_normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    f1 = (2 * precision * recall) / (precision + recall)
    return f1


def official_exact_match_score(prediction, ground_truth):
    return official_normalize_answer(prediction) == official_normalize_answer(ground_truth)


def official_metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
    scores_for_ground_truths = []
    for ground_truth in ground_truths:
        score = metric_fn(prediction, ground_truth)
        scores_for_ground_truths.append(score)
    return max(scores_for_ground_truths)


def official_evaluate(dataset, predictions):
    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue  # "Unanswered question ... will receive score 0."
                ground_truths = list(map(lambda x: x["text"], qa["answers"]))
                prediction = predictions[qa["id"]]
                exact_match += official_metric_max_over_ground_truths(
                    official_exact_match_score, prediction, ground_truths)
                f1 += official_metric_max_over_ground_truths(
                    official_f1_score, prediction, ground_truths)
    exact_match = 100.0 * exact_match / total
    f1 = 100.0 * f1 / total
    return {"exact_match": exact_match, "f1": f1}


@pytest.fixture(scope="module")
def squad_dataset():
    with open(SQUAD_DEV, encoding="utf-8") as f:
        return json.load(f)["data"]


def made_up_prediction(number: int, answers: list[str], other: str) -> str | None:
    """A prediction of each kind a model makes: the gold answer, one cut short, one with an
    article and punctuation around it, a longer one, a wrong one, none at all (None)."""
    gold = answers[number % len(answers)]
    words = gold.split()
    kinds = [
        gold,
        " ".join(words[: max(1, len(words) // 2)]),
        f"The {gold}.",
        f"an {gold.upper()}, (and) more words",
        other,
        None,
        f"  {gold}\t!",
        "",
    ]
    return kinds[number % len(kinds)]


@needs_squad
def test_squad_scores_equal_the_official_scripts_on_the_dev_file(squad_dataset) -> None:
    examples = read_squad(SQUAD_DEV)
    predictions = {}
    for number, example in enumerate(examples):
        other = examples[(number + 7) % len(examples)].answers[0]
        prediction = made_up_prediction(number, example.answers, other)
        if prediction is not None:
            predictions[example.id] = prediction
    assert len(predictions) < len(examples)  # some questions unanswered: they score 0
    ours = metrics.squad_evaluate(examples, predictions)
    assert ours == official_evaluate(squad_dataset, predictions)  # to the last bit
    assert 0 < ours["exact_match"] < ours["f1"] < 100
    for example in examples[:500]:  # and question by question
        prediction = predictions.get(example.id, "")
        assert metrics.normalize_answer(prediction) == official_normalize_answer(prediction)
        assert metrics.max_over_ground_truths(
            metrics.f1_score, prediction, example.answers
        ) == official_metric_max_over_ground_truths(official_f1_score, prediction,
                                                    example.answers)


# --- Google's run_squad.py write_predictions (github.com/google-research/bert) ------------------


def google_get_best_indexes(logits, n_best_size):
    index_and_score = sorted(enumerate(logits), key=lambda x: x[1], reverse=True)
    best_indexes = []
    for i in range(len(index_and_score)):
        if i >= n_best_size:
            break
        best_indexes.append(index_and_score[i][0])
    return best_indexes


def google_check_is_max_context(doc_spans, cur_span_index, position):
    best_score = None
    best_span_index = None
    for span_index, doc_span in enumerate(doc_spans):
        end = doc_span["start"] + doc_span["length"] - 1
        if position < doc_span["start"]:
            continue
        if position > end:
            continue
        num_left_context = position - doc_span["start"]
        num_right_context = end - position
        score = min(num_left_context, num_right_context) + 0.01 * doc_span["length"]
        if best_score is None or score > best_score:
            best_score = score
            best_span_index = span_index
    return cur_span_index == best_span_index


def google_features(features, example_index: int, context_offsets: list):
    """Google's view of one example's windows: for each, its feature row, tokens (the unpadded
    length), token_to_orig_map (position -> context token) and token_is_max_context."""
    rows = [r for r, e in enumerate(features["example_index"].tolist()) if e == example_index]
    spans, positions = [], []
    for row in rows:
        window = features["offset_mapping"][row].tolist()
        where = [p for p, (start, _) in enumerate(window) if start >= 0]
        first = context_offsets.index(tuple(window[where[0]]))
        spans.append({"start": first, "length": len(where)})
        positions.append(where)
    result = []
    for span_index, (row, where) in enumerate(zip(rows, positions, strict=True)):
        start = spans[span_index]["start"]
        to_orig = {p: start + i for i, p in enumerate(where)}
        result.append({
            "row": row,
            "tokens": int(features["attention_mask"][row].sum()),
            "token_to_orig_map": to_orig,
            "token_is_max_context": {
                p: google_check_is_max_context(spans, span_index, start + i)
                for i, p in enumerate(where)
            },
        })
    return result


def google_best_span(google_view, start_logits, end_logits, n_best_size=20,
                     max_answer_length=30):
    """(row, start, end) of write_predictions' best non-null prediction, None: "empty"."""
    prelim = []
    for feature in google_view:
        row = feature["row"]
        for start_index in google_get_best_indexes(start_logits[row].tolist(), n_best_size):
            for end_index in google_get_best_indexes(end_logits[row].tolist(), n_best_size):
                if start_index >= feature["tokens"] or end_index >= feature["tokens"]:
                    continue
                if start_index not in feature["token_to_orig_map"]:
                    continue
                if end_index not in feature["token_to_orig_map"]:
                    continue
                if not feature["token_is_max_context"].get(start_index, False):
                    continue
                if end_index < start_index:
                    continue
                length = end_index - start_index + 1
                if length > max_answer_length:
                    continue
                score = float(start_logits[row, start_index]) + float(end_logits[row, end_index])
                prelim.append((score, row, start_index, end_index))
    prelim = sorted(prelim, key=lambda x: x[0], reverse=True)
    return prelim[0][1:] if prelim else None


@pytest.fixture(scope="module")
def dev_windows():
    """The first 160 dev questions in windows of 128 tokens overlapping by 32 (most contexts
    take several), with the tokenizer that made them."""
    from bertforge.pipelines.contract.tokenization import load_tokenizer

    tokenizer = load_tokenizer(GOOGLE_VOCAB, True)
    examples = read_squad(SQUAD_DEV)[:160]
    return tokenizer, examples, squad_features(tokenizer, examples, 128, 32, 32)


def logits_like_a_model(features, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise, with high logits on some question tokens, [CLS] and [SEP] (as an untrained or
    confused model gives); the padding -inf, as evaluation's trimmed batches leave it for a row
    alone (bertforge never takes a candidate there: `test_padding_is_never_a_candidate`)."""
    generator = torch.Generator().manual_seed(seed)
    start, end = torch.randn(2, *features["input_ids"].shape, generator=generator)
    not_context = features["offset_mapping"][..., 0] < 0
    boost = torch.rand(start.shape, generator=generator) < 0.3
    start[not_context & boost] += 2.0
    end[not_context & boost] += 2.0
    padding = features["attention_mask"] == 0
    return start.masked_fill(padding, float("-inf")), end.masked_fill(padding, float("-inf"))


@needs_squad
@pytest.mark.parametrize("n_best", [20, 3])  # 3: 100 of the 160 left without a valid span
def test_postprocessing_picks_google_run_squads_span(dev_windows, n_best) -> None:
    """The span write_predictions picks, and its "empty" where none is valid ("" was ours)."""
    tokenizer, examples, features = dev_windows
    assert len(features["input_ids"]) > 1.4 * len(examples)  # windows overlap: max context
    start, end = logits_like_a_model(features, 0)
    ours = postprocess_predictions(examples, features, start, end, n_best=n_best)
    assert set(ours) == {e.id for e in examples}  # every question has an answer
    offsets = features["offset_mapping"]
    differ = []
    for index, example in enumerate(examples):
        encoding = tokenizer.encode(example.context, add_special_tokens=False)
        view = google_features(features, index, [tuple(o) for o in encoding.offsets])
        best = google_best_span(view, start, end, n_best_size=n_best)
        expected = "empty" if best is None else example.context[
            int(offsets[best[0], best[1], 0]) : int(offsets[best[0], best[2], 1])]
        if ours[example.id] != expected:
            differ.append((example.id, ours[example.id], expected))
    assert not differ, f"{len(differ)} of {len(examples)} answers differ: {differ[:3]}"


@needs_squad
def test_padding_is_never_a_candidate(dev_windows) -> None:
    """Evaluation trims each batch to its longest row: a row's padding logits are the model's
    within that width and -inf past it, so a padding logit taking one of the n_best places
    made an answer depend on the batch size and the number of workers."""
    _, examples, features = dev_windows
    start, end = logits_like_a_model(features, 0)
    alone = postprocess_predictions(examples, features, start, end)
    padding = features["attention_mask"] == 0
    assert padding.any(dim=1).sum() > 10  # short windows, padded
    in_a_batch = [logits.masked_fill(padding, 50.0) for logits in (start, end)]
    assert postprocess_predictions(examples, features, *in_a_batch) == alone


# --- GLUE's metrics against their textbook definitions -------------------------------------------


def reference_accuracy(predictions, labels):
    return sum(p == y for p, y in zip(predictions, labels, strict=True)) / len(labels)


def reference_mcc(predictions, labels):
    """Binary Matthews correlation from the confusion matrix; 0 where undefined (sklearn)."""
    tp = sum(p == 1 and y == 1 for p, y in zip(predictions, labels, strict=True))
    tn = sum(p == 0 and y == 0 for p, y in zip(predictions, labels, strict=True))
    fp = sum(p == 1 and y == 0 for p, y in zip(predictions, labels, strict=True))
    fn = sum(p == 0 and y == 1 for p, y in zip(predictions, labels, strict=True))
    denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denominator == 0 else (tp * tn - fp * fn) / denominator


def reference_f1(predictions, labels, positive=1):
    tp = sum(p == positive and y == positive for p, y in zip(predictions, labels, strict=True))
    fp = sum(p == positive and y != positive for p, y in zip(predictions, labels, strict=True))
    fn = sum(p != positive and y == positive for p, y in zip(predictions, labels, strict=True))
    if tp == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 2 * precision * recall / (precision + recall)


def reference_pearson(x, y):
    n = len(x)
    mean_x, mean_y = sum(x) / n, sum(y) / n
    covariance = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y, strict=True))
    spread = math.sqrt(sum((a - mean_x) ** 2 for a in x) * sum((b - mean_y) ** 2 for b in y))
    return 0.0 if spread == 0 else covariance / spread


def reference_ranks(values):
    """1-based ranks, ties given the mean of the ranks they span (scipy's 'average'): a value
    with `below` smaller ones and `ties` equal ones spans ranks below + 1 .. below + ties."""
    ordered = sorted(values)
    ranks = []
    for value in values:
        below, through = bisect.bisect_left(ordered, value), bisect.bisect_right(ordered, value)
        ranks.append((below + 1 + through) / 2)
    return ranks


def reference_spearman(x, y):
    return reference_pearson(reference_ranks(x), reference_ranks(y))


def binary_cases():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    yield labels, rng.integers(0, 2, 200)  # random
    yield labels, labels  # perfect
    yield labels, 1 - labels  # all wrong
    yield labels, np.zeros(200, dtype=int)  # one class predicted
    yield labels, np.ones(200, dtype=int)
    yield np.zeros(50, dtype=int), rng.integers(0, 2, 50)  # one class in the labels
    yield np.ones(50, dtype=int), np.ones(50, dtype=int)  # one class in both
    yield np.array([1]), np.array([0])


@pytest.mark.parametrize("labels, predictions", list(binary_cases()))
def test_classification_metrics_equal_their_definitions(labels, predictions) -> None:
    p, y = predictions.tolist(), labels.tolist()
    mcc = metrics.matthews_corrcoef(predictions, labels)
    assert not math.isnan(mcc) and mcc == pytest.approx(reference_mcc(p, y), abs=1e-12)
    assert metrics.f1_binary(predictions, labels) == pytest.approx(reference_f1(p, y), abs=1e-12)
    assert metrics.accuracy(predictions, labels) == reference_accuracy(p, y)


def regression_cases():
    rng = np.random.default_rng(1)
    gold = np.round(rng.uniform(0, 5, 300) * 5) / 5  # STS-B's scores: many ties
    yield rng.normal(2.5, 1, 300), gold
    yield np.round(rng.normal(2.5, 1, 300)), gold  # ties on both sides
    yield gold * 2 + 1, gold  # perfect, affine
    yield -gold, gold
    yield np.full(300, 3.0), gold  # a constant prediction: 0, not NaN
    yield gold, np.full(300, 3.0)
    yield np.array([1.0, 1.0, 2.0]), np.array([2.0, 1.0, 1.0])


@pytest.mark.parametrize("predictions, labels", list(regression_cases()))
def test_correlations_equal_their_definitions(predictions, labels) -> None:
    p, y = predictions.tolist(), labels.tolist()
    assert metrics.pearson(predictions, labels) == pytest.approx(reference_pearson(p, y),
                                                                 abs=1e-12)
    assert metrics.spearman(predictions, labels) == pytest.approx(reference_spearman(p, y),
                                                                  abs=1e-12)
    assert metrics.average_ranks(predictions).tolist() == reference_ranks(p)


@pytest.mark.skipif(not os.path.isdir(GLUE_DIR), reason="../shared/data/glue is absent")
@pytest.mark.parametrize("task", ["sst2", "cola", "mrpc", "rte", "stsb"])
def test_glue_task_metrics_on_the_real_dev_files(task) -> None:
    """Each task's metrics, as results.json names them, for made-up predictions on its dev
    labels: a noisy copy of the gold labels, and always the commonest one (chance)."""
    spec = task_spec(task)
    labels = np.array([e.label for e in read_examples(os.path.join(GLUE_DIR, spec.dev_file),
                                                      spec)])
    # Every dev example, as GLUE's (and Hugging Face's glue dataset's) counts: one left out
    # or a header read as one is a score over another set than the published ones.
    assert labels.size == {"sst2": 872, "cola": 1043, "mrpc": 408, "rte": 277,
                           "stsb": 1500}[task]
    rng = np.random.default_rng(2)
    if spec.is_regression:
        predictions = labels + rng.normal(0, 1.5, labels.size)
        expected = {"pearson": reference_pearson(predictions.tolist(), labels.tolist()),
                    "spearman": reference_spearman(predictions.tolist(), labels.tolist())}
    else:
        flip = rng.random(labels.size) < 0.25
        predictions = np.where(flip, 1 - labels, labels)
        p, y = predictions.tolist(), labels.tolist()
        everything = {"accuracy": reference_accuracy(p, y),
                      "f1": reference_f1(p, y), "matthews_corrcoef": reference_mcc(p, y)}
        expected = {name: everything[name] for name in spec.metrics}
        chance = metrics.chance_level(spec, labels)["metrics"]
        assert chance.get("matthews_corrcoef", 0.0) == 0.0  # one class: 0, not NaN
    assert metrics.task_metrics(spec, predictions, labels) == pytest.approx(expected, abs=1e-12)
