"""Task heads on our BERT encoder, laid out as Hugging Face's so the export is a rename.

- `BertForSequenceClassification`: [CLS] -> pooler (tanh) -> dropout -> `classifier`;
  cross-entropy, or MSE when num_labels == 1 (a regression such as STS-B), as Hugging Face's.
- `BertForQuestionAnswering`: every token -> `qa_outputs` [2, H] -> start and end logits; the loss
  is the mean of the two cross-entropies, positions outside the window clamped and ignored as in
  Hugging Face's. Like Hugging Face's, it has no pooler (nothing would train it).

The encoder is `training.model.BertModel` (fused QKV); its word embeddings hold exactly vocab_size
rows here: the padding to a multiple of 64 only serves the pretraining MLM decoder's GEMM.
Nothing of training lives here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from bertforge.training.cpu_kernels import Dropout, Linear
from bertforge.training.model import BertConfig, BertForPreTraining, BertModel, key_padding_mask

CLASSIFIER_PREFIX = "classifier."
QA_PREFIX = "qa_outputs."


class _TaskModel(nn.Module):
    """The encoder plus a head; `load_encoder` takes pretrained weights, our names."""

    has_pooler = True

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        if self.has_pooler:  # replaced by pretrained weights unless the source has none
            self._init_head(self.bert.pooler.dense)
        else:
            del self.bert.pooler

    def _init_head(self, head: nn.Linear) -> None:
        """Hugging Face's init of a new head: N(0, initializer_range) weight, zero bias."""
        with torch.no_grad():
            head.weight.normal_(mean=0.0, std=self.config.initializer_range)
            head.bias.zero_()

    def init_encoder_randomly(self) -> None:
        """Pretraining's init (a seeded `BertForPreTraining`'s draws), for a random-init run."""
        self.load_encoder(BertForPreTraining(self.config).state_dict())

    def load_encoder(self, state_dict: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy the `bert.*` tensors of a pretraining state dict (padded vocabulary rows cut);
        returns the encoder parameters it did not hold (the pooler of some sources), which
        keep their initial values."""
        own = self.bert.state_dict()
        given = {name.removeprefix("bert."): tensor for name, tensor in state_dict.items()
                 if name.startswith("bert.") and name.removeprefix("bert.") in own}
        word = "embeddings.word_embeddings.weight"
        given[word] = given[word][: self.config.vocab_size]
        missing = sorted(set(own) - set(given))
        if any(not name.startswith("pooler.") for name in missing):
            raise ValueError(f"the pretrained weights lack encoder tensors {missing[:5]}")
        self.bert.load_state_dict(given, strict=False)
        return missing

    def _encode(self, input_ids, token_type_ids, attention_mask) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.bert.embeddings(input_ids, token_type_ids)
        return self.bert.encoder(embeddings, key_padding_mask(attention_mask))


class BertForSequenceClassification(_TaskModel):
    def __init__(self, config: BertConfig, num_labels: int) -> None:
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        super().__init__(config)
        self.num_labels = num_labels
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.classifier = Linear(config.hidden_size, num_labels)
        self._init_head(self.classifier)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """{"logits": [B, num_labels]} and "loss" (a mean over the batch) with labels."""
        sequence_output = self._encode(input_ids, token_type_ids, attention_mask)
        pooled = self.bert.pooler(sequence_output[:, 0])
        logits = self.classifier(self.dropout(pooled))
        out = {"logits": logits}
        if labels is not None:
            if self.num_labels == 1:
                out["loss"] = F.mse_loss(logits.float().squeeze(-1), labels.float())
            else:
                out["loss"] = F.cross_entropy(logits.float(), labels.long())
        return out


class BertForQuestionAnswering(_TaskModel):
    has_pooler = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.qa_outputs = Linear(config.hidden_size, 2)
        self._init_head(self.qa_outputs)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None, end_positions: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """{"start_logits", "end_logits"}: [B, S] each; "loss" with both positions given."""
        sequence_output = self._encode(input_ids, token_type_ids, attention_mask)
        start_logits, end_logits = self.qa_outputs(sequence_output).float().unbind(dim=-1)
        out = {"start_logits": start_logits, "end_logits": end_logits}
        if start_positions is not None and end_positions is not None:
            # As Hugging Face: positions past the window are clamped to S and ignored.
            ignored = start_logits.shape[1]
            start = start_positions.long().clamp(0, ignored)
            end = end_positions.long().clamp(0, ignored)
            out["loss"] = (F.cross_entropy(start_logits, start, ignore_index=ignored)
                           + F.cross_entropy(end_logits, end, ignore_index=ignored)) / 2
        return out


def task_model(config: BertConfig, num_labels: int | None) -> _TaskModel:
    """The classifier with `num_labels` outputs, or the span model for None (SQuAD)."""
    if num_labels is None:
        return BertForQuestionAnswering(config)
    return BertForSequenceClassification(config, num_labels)
