"""A bag-of-words baseline for GLUE-style tasks: what a fine-tuned BERT has to beat.

Features are binary unigrams and bigrams of each text (the second text of a pair in its own
namespace, `b:`), weighted by tf-idf and L2-normalised per example. The vocabulary is the
`max_features` n-grams seen in the most training examples (at least `min_count`), ties broken
alphabetically. A classification task fits a multinomial logistic regression, a regression task
(STS-B) a ridge regression, both with an L2 penalty, full batch with torch's L-BFGS from zero
weights: the objective is strictly convex, so the fit is unique and the same on every run.

numpy/torch only, so it adds no dependency; it runs on the same examples the fine-tune sees.
"""

from __future__ import annotations

import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bertforge.training.finetune.glue_data import Example
from bertforge.training.finetune.metrics import task_metrics
from bertforge.training.finetune.tasks import TaskSpec

# Words (with inner apostrophes: "don't") and single punctuation marks; SST-2's text is already
# PTB-tokenised and lower-cased, the other tasks' is raw.
_TOKEN = re.compile(r"\w+(?:'\w+)*|[^\w\s]")


def ngrams(text: str, prefix: str = "") -> set[str]:
    """The distinct unigrams and bigrams of `text`, lower-cased, each with `prefix`."""
    words = _TOKEN.findall(text.lower())
    grams = {prefix + w for w in words}
    grams.update(f"{prefix}{a} {b}" for a, b in zip(words, words[1:], strict=False))
    return grams


def example_ngrams(example: Example) -> set[str]:
    grams = ngrams(example.text_a)
    if example.text_b is not None:
        grams |= ngrams(example.text_b, prefix="b:")
    return grams


def build_vocabulary(
    docs: Sequence[set[str]], max_features: int, min_count: int
) -> tuple[dict[str, int], np.ndarray]:
    """{n-gram: column} of the most frequent n-grams, and each column's idf (smoothed, as
    scikit-learn's: log((1 + n) / (1 + df)) + 1)."""
    counts = Counter(g for doc in docs for g in doc)
    kept = sorted((g for g, c in counts.items() if c >= min_count),
                  key=lambda g: (-counts[g], g))[:max_features]
    vocab = {g: i for i, g in enumerate(kept)}
    df = np.array([counts[g] for g in kept], dtype=np.float64)
    idf = np.log((1.0 + len(docs)) / (1.0 + df)) + 1.0
    return vocab, idf


def featurize(docs: Sequence[set[str]], vocab: dict[str, int], idf: np.ndarray) -> torch.Tensor:
    """A sparse CSR [len(docs), len(vocab)] float32 tf-idf matrix, each non-empty row of norm 1."""
    columns = [sorted(vocab[g] for g in doc if g in vocab) for doc in docs]
    lengths = np.array([len(c) for c in columns], dtype=np.int64)
    rows = np.repeat(np.arange(len(docs)), lengths)
    cols = np.fromiter((i for c in columns for i in c), dtype=np.int64, count=int(lengths.sum()))
    values = idf[cols]
    norms = np.sqrt(np.bincount(rows, weights=values ** 2, minlength=len(docs)))
    values = values / norms[rows]
    crow = np.concatenate([[0], np.cumsum(lengths)])
    with warnings.catch_warnings():  # "sparse CSR support is in beta": what we use works
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(
            torch.from_numpy(crow), torch.from_numpy(cols),
            torch.from_numpy(values.astype(np.float32)), (len(docs), len(vocab)),
            check_invariants=False,  # built sorted and in range above
        )


def fit_linear(
    features: torch.Tensor, targets: torch.Tensor, num_outputs: int, l2: float, max_iter: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [F, K], bias [K]) minimising mean cross-entropy (K > 1) or mean squared error
    (K = 1) + l2/2 * |weight|^2 (the bias is not penalised).

    The gradient is written out (X^T (p - y) / n, with a CSR copy of X^T made once) rather than
    taken by autograd through a sparse product, which would re-transpose X on every evaluation.
    """
    transposed = features.to_sparse_coo().t().coalesce().to_sparse_csr()
    num_features, n = features.shape[1], features.shape[0]

    def loss_and_gradient(params: torch.Tensor) -> tuple[float, torch.Tensor]:
        weight = params[:-num_outputs].view(num_features, num_outputs)
        bias = params[-num_outputs:]
        outputs = features @ weight + bias
        if num_outputs == 1:
            residual = outputs.squeeze(1) - targets
            loss = residual.pow(2).mean()
            d_outputs = (2.0 / n) * residual.unsqueeze(1)
        else:
            loss = F.cross_entropy(outputs, targets)
            d_outputs = (outputs.softmax(dim=1) - F.one_hot(targets, num_outputs)) / n
        loss = loss + 0.5 * l2 * weight.pow(2).sum()
        gradient = torch.cat([(transposed @ d_outputs + l2 * weight).reshape(-1),
                              d_outputs.sum(dim=0)])
        return float(loss), gradient

    params = lbfgs(loss_and_gradient, torch.zeros((num_features + 1) * num_outputs), max_iter)
    return params[:-num_outputs].view(num_features, num_outputs), params[-num_outputs:]


def lbfgs(
    loss_and_gradient: Callable[[torch.Tensor], tuple[float, torch.Tensor]], x: torch.Tensor,
    max_iter: int, history: int = 10, tolerance: float = 1e-7,
) -> torch.Tensor:
    """Minimise a smooth convex function: L-BFGS (two-loop recursion) with Armijo backtracking.

    Written out because torch.optim's first step imports torch._dynamo (seconds on 2 cores).
    """
    loss, grad = loss_and_gradient(x)
    pairs: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # (s, y, 1 / y.s), oldest first
    for _ in range(max_iter):
        q, alphas = grad.clone(), []
        for s, y, rho in reversed(pairs):
            alpha = rho * float(s @ q)
            q -= alpha * y
            alphas.append(alpha)
        if pairs:  # initial Hessian scale s.y / y.y, as Nocedal & Wright (7.20)
            s, y, _ = pairs[-1]
            q *= float(s @ y) / float(y @ y)
        else:
            q /= max(1.0, float(grad.norm()))
        for (s, y, rho), alpha in zip(pairs, reversed(alphas), strict=True):
            q += s * (alpha - rho * float(y @ q))
        direction, step, slope = -q, 1.0, -float(grad @ q)
        while True:  # Armijo: accept the first halving that decreases the loss enough
            new_x = x + step * direction
            new_loss, new_grad = loss_and_gradient(new_x)
            if new_loss <= loss + 1e-4 * step * slope or step < 1e-10:
                break
            step *= 0.5
        s, y = new_x - x, new_grad - grad
        if float(s @ y) > 1e-12:
            pairs = (pairs + [(s, y, 1.0 / float(s @ y))])[-history:]
        done = loss - new_loss <= tolerance * max(1.0, abs(loss))
        x, loss, grad = new_x, new_loss, new_grad
        if done:
            break
    return x


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """These are many small ops ([n, 2] tensors): OpenMP's thread hand-offs cost more than they
    save, and on a busy machine spinning threads made them ~100x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bow_baseline(
    train_examples: Sequence[Example], dev_examples: Sequence[Example], spec: TaskSpec,
    seed: int = 0, *, max_features: int = 50_000, min_count: int = 1, l2: float = 1e-4,
    max_iter: int = 200,
) -> dict[str, Any]:
    """Fit on `train_examples`, score `dev_examples` with the task's metrics (a regression task
    fits a ridge regression).

    Returns {"metrics", "seconds", "num_features", "num_train", "num_dev", "predictions",
    "seed"}. The fit has no randomness (zero start, full batch, convex), so `seed` is only
    recorded, to sit beside the fine-tunes it is compared with.
    """
    if not train_examples or not dev_examples:
        raise ValueError("the bag-of-words baseline needs training and dev examples")
    started = time.perf_counter()
    with one_torch_thread():
        train_docs = [example_ngrams(e) for e in train_examples]
        vocab, idf = build_vocabulary(train_docs, max_features, min_count)
        targets = torch.tensor([float(e.label) if spec.is_regression else int(e.label)
                                for e in train_examples])
        weight, bias = fit_linear(featurize(train_docs, vocab, idf), targets, spec.num_labels,
                                  l2, max_iter)
        dev_x = featurize([example_ngrams(e) for e in dev_examples], vocab, idf)
        outputs = dev_x @ weight + bias
    predictions = (outputs.squeeze(1).tolist() if spec.is_regression
                   else outputs.argmax(dim=1).tolist())
    metrics = task_metrics(spec, predictions, [e.label for e in dev_examples])
    return {
        "metrics": {name: float(value) for name, value in metrics.items()},
        "seconds": round(time.perf_counter() - started, 2),
        "num_features": len(vocab),
        "num_train": len(train_examples),
        "num_dev": len(dev_examples),
        "predictions": predictions,
        "seed": seed,
    }
