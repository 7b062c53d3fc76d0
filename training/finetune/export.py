"""A fine-tuned model as a Hugging Face directory that `AutoModelForSequenceClassification` or
`AutoModelForQuestionAnswering` loads with no missing or unexpected keys, and the same logits.

The encoder goes through `training.hf_interop`'s literal name map (fused QKV split); the heads
already carry Hugging Face's names (`classifier.*`, `qa_outputs.*`). config.json says which
head, its labels (`id2label`, the task's label strings in id order) and the problem type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bertforge.training.finetune.model import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
)
from bertforge.training.hf_interop import (
    encoder_name_map,
    hf_config_dict,
    rename_to_hf,
    strip_wrapper_prefixes,
    write_hf_directory,
)
from bertforge.training.model import BertConfig


def finetuned_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors in Hugging Face's names and layout, fp32 on CPU."""
    config: BertConfig = model.config
    state = {strip_wrapper_prefixes(name): tensor for name, tensor in model.state_dict().items()}
    encoder = {name: tensor for name, tensor in state.items() if name.startswith("bert.")}
    has_pooler = "bert.pooler.dense.weight" in encoder
    hf = rename_to_hf(encoder, encoder_name_map(config.num_hidden_layers, pooler=has_pooler),
                      config)
    for name, tensor in state.items():
        if not name.startswith("bert."):  # the head: Hugging Face's names already
            hf[name] = tensor.detach().to("cpu", torch.float32).contiguous().clone()
    return hf


def finetuned_config_dict(
    model: torch.nn.Module, labels: Sequence[str] | None, task: str
) -> dict[str, Any]:
    """config.json: the encoder's fields, the head's architecture, labels and problem type."""
    values = hf_config_dict(model.config)
    values.pop("tie_word_embeddings")  # no MLM decoder to tie
    values["finetuning_task"] = task
    if isinstance(model, BertForQuestionAnswering):
        values["architectures"] = ["BertForQuestionAnswering"]
        return values
    if not isinstance(model, BertForSequenceClassification):
        raise TypeError(f"no Hugging Face export for {type(model).__name__}")
    values["architectures"] = ["BertForSequenceClassification"]
    if model.num_labels == 1:
        names = ["LABEL_0"]
        values["problem_type"] = "regression"
    else:
        names = list(labels) if labels is not None else [
            f"LABEL_{i}" for i in range(model.num_labels)]
        if len(names) != model.num_labels:
            raise ValueError(f"{len(names)} label names for a {model.num_labels}-way classifier")
        values["problem_type"] = "single_label_classification"
    values["id2label"] = {str(i): name for i, name in enumerate(names)}
    values["label2id"] = {name: i for i, name in enumerate(names)}
    return values


def export_finetuned(
    model: torch.nn.Module, vocab_path: str, lower_case: bool, output_dir: str, *,
    labels: Sequence[str] | None = None, task: str = "", overwrite: bool = False,
    positions_trained: int | None = None,
) -> str:
    """Write the Hugging Face directory (model, config, vocab, tokenizer); returns its path.
    `positions_trained`: the longest sequences its training saw, the tokenizer's
    model_max_length (as `bertforge export` writes it), where fewer than the model's table."""
    return write_hf_directory(
        finetuned_hf_state_dict(model), finetuned_config_dict(model, labels, task),
        model.config, vocab_path, lower_case, output_dir, overwrite=overwrite,
        model_max_length=positions_trained,
    )
