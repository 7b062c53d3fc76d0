"""`evaluate`'s baselines: what always giving the split's most frequent answer scores, on the
very rows the model is scored on."""

from types import SimpleNamespace

import pytest
import torch

from bertforge.training.evaluate import evaluate


class AlwaysRandomNext(torch.nn.Module):
    """Predicts token 5 everywhere and "random next" (label 1) for every pair."""

    def forward(self, labels, next_sentence_label):
        logits = torch.zeros(*labels.shape, 8)
        logits[..., 5] = 1.0
        nsp_logits = torch.zeros(*next_sentence_label.shape, 2)
        nsp_logits[..., 1] = 1.0
        return SimpleNamespace(prediction_labels=labels, prediction_logits=logits,
                               seq_relationship_logits=nsp_logits,
                               mlm_loss=torch.tensor(1.0), nsp_loss=torch.tensor(0.7))


def test_nsp_accuracy_is_reported_beside_always_guessing_the_commoner_label():
    """A 57-row split with 32 real next pairs: a model always saying "random" scored 0.44 and
    nothing said that one constant guess scores 0.56. Packed rows' empty slots (-100) count
    for neither."""
    batches = [
        {"labels": torch.tensor([[5, -100], [3, 5]]),
         "next_sentence_label": torch.tensor([0, 0])},
        {"labels": torch.tensor([[5, 5]]), "next_sentence_label": torch.tensor([[0, 1, -100]])},
    ]
    result = evaluate(AlwaysRandomNext(), iter(batches), baseline_token_id=5)
    assert result.num_sequences == 4
    assert result.nsp_accuracy == pytest.approx(1 / 4)
    assert result.nsp_baseline_accuracy == pytest.approx(3 / 4)  # always "real next"
    assert result.mlm_baseline_accuracy == pytest.approx(4 / 5)
    assert "nsp_baseline_accuracy" in result.to_dict()  # `bertforge eval`'s JSON
