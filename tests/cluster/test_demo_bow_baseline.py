"""The bag-of-words logistic-regression baseline: its optimiser, a separable toy task, SST-2."""

from __future__ import annotations

import os

import pytest
import torch

from bertforge.cluster.demo.bow_baseline import bow_baseline, lbfgs, ngrams
from bertforge.training.finetune.glue_data import Example
from bertforge.training.finetune.tasks import GLUE_TASKS, custom_task, glue_dir_files

GLUE_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "glue")


def examples(rows: list[tuple[str, int | float]], text_b: str | None = None) -> list[Example]:
    return [Example(text, text_b, label, line) for line, (text, label) in enumerate(rows, 2)]


def test_ngrams_are_lower_cased_unigrams_and_bigrams_with_the_pair_prefix() -> None:
    assert ngrams("It 's GOOD .") == {"it", "'", "s", "good", ".", "it '", "' s", "s good",
                                      "good ."}
    assert ngrams("don't stop", prefix="b:") == {"b:don't", "b:stop", "b:don't stop"}


def test_lbfgs_finds_the_minimum_of_a_quadratic() -> None:
    # f(x) = 1/2 x^T A x - b^T x has its minimum at A^-1 b.
    a = torch.tensor([[3.0, 1.0, 0.0], [1.0, 2.0, 0.5], [0.0, 0.5, 1.0]])
    b = torch.tensor([1.0, -2.0, 0.5])

    def loss_and_gradient(x: torch.Tensor) -> tuple[float, torch.Tensor]:
        return float(0.5 * x @ a @ x - b @ x), a @ x - b

    found = lbfgs(loss_and_gradient, torch.zeros(3), max_iter=100, tolerance=1e-12)
    assert torch.allclose(found, torch.linalg.solve(a, b), atol=1e-4)


def test_learns_a_task_where_the_words_decide_the_label() -> None:
    spec = GLUE_TASKS["sst2"]
    good, bad = ("great", "superb", "moving", "fun"), ("dull", "awful", "tedious", "weak")
    fillers = ("the film is", "a plot that is", "it was", "acting , very")
    train = examples([(f"{f} {w} .", label) for f in fillers
                      for label, words in ((1, good), (0, bad)) for w in words])
    dev = examples([(f"really {w} stuff", label) for label, words in ((1, good), (0, bad))
                    for w in words])
    result = bow_baseline(train, dev, spec)
    assert result["metrics"] == {"accuracy": 1.0}
    assert result["predictions"] == [e.label for e in dev]
    assert (result["num_train"], result["num_dev"]) == (32, 8) and result["seconds"] >= 0
    # The words are all it has: with the labels flipped it predicts the flipped labels.
    flipped = examples([(e.text_a, 1 - e.label) for e in train])
    assert bow_baseline(flipped, dev, spec)["metrics"] == {"accuracy": 0.0}


def test_a_pair_task_and_a_regression() -> None:
    pairs = custom_task(("s1", "s2"), "label", labels=("no", "yes"))
    train = [Example("a cat sat", b, int(b.startswith("same")), 2 + i)
             for i, b in enumerate(["same cat", "other dog", "same mat", "other log"] * 4)]
    dev = [Example("a bird sang", "same song", 1, 2), Example("a bird", "other tree", 0, 3)]
    assert bow_baseline(train, dev, pairs)["metrics"]["accuracy"] == 1.0

    scores = custom_task(("s1", "s2"), "score", labels=None)
    words = ("unrelated", "distant", "loose", "related", "close", "identical")  # score 0-5
    train = examples([(f"{opener} {w}", float(k)) for opener in ("the pair is", "they are")
                      for k, w in enumerate(words)])
    dev = examples([(f"quite {words[k]}", float(k)) for k in (2, 5, 0)])
    result = bow_baseline(train, dev, scores, l2=1e-6)
    assert result["metrics"]["spearman"] == pytest.approx(1.0)
    assert result["predictions"][1] > result["predictions"][0] > result["predictions"][2]


def test_the_fit_is_the_same_every_time() -> None:
    spec = GLUE_TASKS["sst2"]
    train = examples([(f"word{i % 7} and word{i % 5}", i % 2) for i in range(60)])
    dev = examples([(f"word{i % 3} then word{i % 4}", i % 2) for i in range(20)])
    first, second = bow_baseline(train, dev, spec), bow_baseline(train, dev, spec, seed=7)
    assert first["predictions"] == second["predictions"]
    assert first["metrics"] == second["metrics"]


def test_refuses_empty_inputs() -> None:
    with pytest.raises(ValueError, match="needs training and dev examples"):
        bow_baseline([], examples([("x", 1)]), GLUE_TASKS["sst2"])


@pytest.mark.skipif(not os.path.isdir(os.path.join(GLUE_DIR, "SST-2")),
                    reason="../shared/data/glue/SST-2 (the real SST-2 files) is absent")
def test_sst2_dev_accuracy_from_10000_training_sentences() -> None:
    from bertforge.training.finetune.glue_data import read_examples
    from bertforge.training.finetune.task_data import subsample

    spec = GLUE_TASKS["sst2"]
    train_path, dev_path = glue_dir_files(GLUE_DIR, spec)
    train = subsample(read_examples(train_path, spec), 10_000)
    result = bow_baseline(train, read_examples(dev_path, spec), spec)
    # Measured 0.784 (2,000: 0.747; 4,000: 0.768; all 67,349: 0.814); the majority class is 0.509.
    assert result["metrics"]["accuracy"] > 0.76
    assert result["num_dev"] == 872
