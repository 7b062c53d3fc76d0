"""MODEL for fine-tuning: a bertforge checkpoint, a run directory, or a Hugging Face BERT directory.

Whatever the source, the result is the encoder in our names (`bert.*`, fused QKV, vocabulary rows
as the pretraining model holds them), its config, the vocabulary and casing to tokenize with, and
where it came from (results.json records that). Checkpoints go through `training.warm_start`; a
Hugging Face directory may be a pretraining export, `bert-base-uncased` as downloaded, a bare
`BertModel` save (no `bert.` prefix) or an earlier fine-tuned export: only its encoder is read.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, NamedTuple

import torch

from bertforge.pipelines.contract.manifest import sha256_file
from bertforge.pipelines.contract.tokenization import read_vocab
from bertforge.training import checkpoint
from bertforge.training.hf_interop import (
    HF_CONFIG_NAME,
    HF_TOKENIZER_NAME,
    HF_WEIGHTS_NAMES,
    TokenizerFile,
    bert_tensors,
    config_from_hf_dict,
    encoder_name_map,
    hf_lower_case,
    hf_positions_trained,
    hf_vocab_file,
    hf_weights_file,
    load_hf_weights,
    rename_from_hf,
    tokens_beyond_vocab,
    vocab_files_disagree,
)
from bertforge.training.inputs import check_model_source
from bertforge.training.model import BertConfig
from bertforge.training.warm_start import read_initial_weights

CHECKPOINT, RUN_DIR, HF_DIR = "checkpoint", "run_dir", "hf_dir"
_WHAT_WE_TAKE = ("a bertforge checkpoint, a run directory with one, or a Hugging Face BERT "
                 f"directory ({HF_CONFIG_NAME}, {HF_WEIGHTS_NAMES[0]}, and vocab.txt or "
                 "tokenizer.json)")


class PretrainedModel(NamedTuple):
    config: BertConfig
    state_dict: dict[str, torch.Tensor] | None  # None with random_init: the loop draws it
    vocab_path: str
    lower_case: bool
    provenance: dict[str, Any]


def source_kind(source: str) -> str:
    """checkpoint, run_dir or hf_dir; a clear error for anything else. Which of them holds
    what the load needs is `training.inputs.check_model_source`'s rule (the driver's
    pre-flight): `load_pretrained` applies it when it reads weights, after naming a non-BERT
    config.json (random init needs config.json and vocab.txt only)."""
    if not os.path.isdir(source):
        what = "a file, not a directory" if os.path.isfile(source) else "no such directory"
        raise ValueError(f"model {source}: {what}; give {_WHAT_WE_TAKE}")
    if os.path.exists(os.path.join(source, checkpoint.COMMIT_MARKER)):
        return CHECKPOINT
    if checkpoint.latest_checkpoint(source) is not None:
        return RUN_DIR  # checked before HF: a run directory holds a config.json too
    if checkpoint.run_marks(source):  # its config.json is the run's, not a model's
        raise ValueError(f"model {checkpoint.no_checkpoint_yet(source)}")
    if os.path.exists(os.path.join(source, HF_CONFIG_NAME)):
        return HF_DIR
    raise ValueError(f"model {source} is none of {_WHAT_WE_TAKE}")


def load_pretrained(source: str, *, random_init: bool = False,
                    vocab_copy_dir: str | None = None) -> PretrainedModel:
    """The encoder of `source`; `random_init` keeps its architecture and vocabulary but none of
    its weights (state_dict None), for comparing fine-tuning with and without pretraining.
    `vocab_copy_dir`: a checkpoint's vocabulary is copied there, read with its weights (the
    vocab_path then names the copy), for a caller that reads it later."""
    kind = source_kind(source)
    loaded = (_from_checkpoint(source, kind, random_init, vocab_copy_dir) if kind != HF_DIR
              else _from_hf_dir(source, random_init))
    num_tokens = len(read_vocab(loaded.vocab_path, allow_repeats=True))
    if num_tokens > loaded.config.vocab_size:
        raise ValueError(f"model {source}: {loaded.vocab_path} has {num_tokens} tokens, more than "
                         f"the model's vocab_size {loaded.config.vocab_size}")
    return loaded


def _from_checkpoint(source: str, kind: str, random_init: bool,
                     vocab_copy_dir: str | None) -> PretrainedModel:
    def read(path: str):
        metadata = checkpoint.read_metadata(path)
        vocab_path = os.path.join(path, "vocab.txt")
        if vocab_copy_dir is not None:
            vocab_path = shutil.copy(vocab_path, vocab_copy_dir)
        if random_init:
            return metadata, checkpoint.model_config_of(path, metadata), None, vocab_path
        initial = read_initial_weights(path)
        return metadata, initial.config, initial.state_dict, vocab_path

    # Everything read at once, a run's newest picked again if a train still running there
    # removes it meanwhile.
    path, (metadata, config, state, vocab_path) = checkpoint.read_newest(source, read)
    provenance = _provenance(source, kind, random_init, vocab_path,
                             step=metadata["global_step"], checkpoint=os.path.abspath(path),
                             weights={"run_id": metadata.get("run_id"),
                                      "step": metadata["global_step"]},
                             positions_trained=checkpoint.positions_trained(metadata))
    return PretrainedModel(config, state, vocab_path, bool(metadata["lower_case"]), provenance)


def _from_hf_dir(source: str, random_init: bool) -> PretrainedModel:
    config = _hf_config(source)
    tokenizer_file = TokenizerFile(source)  # read and parsed once for all that asks it
    try:
        vocab_path = hf_vocab_file(source, tokenizer_file)
    except ValueError as error:
        raise ValueError(f"model {source}: {error}") from None
    if vocab_path is None:
        raise ValueError(f"model {source} has no vocab.txt or tokenizer.json: a BERT directory "
                         "brings its WordPiece vocabulary")
    if not random_init:  # weights required: the driver's pre-flight rule, checked here too
        check_model_source(source)
    state = None if random_init else _hf_encoder(source, config)
    provenance = _provenance(source, HF_DIR, random_init, vocab_path, step=None,
                             positions_trained=hf_positions_trained(source, config),
                             weights=_weights_file_identity(source))
    if state is not None and "bert.pooler.dense.weight" not in state:
        provenance["pooler"] = "initialised randomly (the source has none)"
    lower_case = _hf_lower_case(source, tokenizer_file)
    _refuse_another_tokenizer(source, vocab_path, lower_case, tokenizer_file)
    return PretrainedModel(config, state, vocab_path, lower_case, provenance)


def _refuse_another_tokenizer(source: str, vocab_path: str, lower_case: bool,
                              tokenizer_file: TokenizerFile) -> None:
    """Where the model's own tokenizer gives a text other ids than fine-tuning here would (its
    tokenizer.json and vocab.txt disagree; it adds tokens, `add_tokens` or [E1] markers, that
    ours would split): fine-tuned on other ids, the export's tokenizer not its, silently."""
    differ = vocab_files_disagree(source, tokenizer_file)
    if differ:
        raise ValueError(
            f"model {source}: its vocab.txt and {HF_TOKENIZER_NAME} hold different vocabularies "
            f"({differ}): transformers' fast tokenizer reads {HF_TOKENIZER_NAME}, fine-tuning "
            "here vocab.txt; remove the stale one")
    added = tokens_beyond_vocab(source, vocab_path, lower_case, tokenizer_file)
    if added:
        shown = ", ".join(added[:5]) + (", ..." if len(added) > 5 else "")
        raise ValueError(
            f"model {source}: its tokenizer adds {len(added)} token(s) that fine-tuning here, "
            f"with its WordPiece vocabulary alone, would split into pieces ({shown}); write "
            "each word of them into its vocab.txt at its id (WordPiece then reads it whole), "
            "or fine-tune it with its own tokenizer in transformers")


def _hf_config(source: str) -> BertConfig:
    with open(os.path.join(source, HF_CONFIG_NAME), encoding="utf-8") as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"model {source}: {HF_CONFIG_NAME} is not JSON ({error})") from None
    model_type = values.get("model_type")
    if model_type != "bert":
        raise ValueError(f"model {source} is not a BERT model: its {HF_CONFIG_NAME} says "
                         f"model_type {model_type!r}; fine-tuning takes {_WHAT_WE_TAKE}")
    try:
        return config_from_hf_dict(values)
    except ValueError as error:
        raise ValueError(f"model {source}: {error}") from None


def _hf_encoder(source: str, config: BertConfig) -> dict[str, torch.Tensor]:
    """The `bert.*` tensors in our names, whatever head the directory was saved with."""
    try:
        encoder = bert_tensors(load_hf_weights(source))
    except ValueError as error:
        raise ValueError(f"model {source}: {error}") from None
    encoder.pop("bert.embeddings.position_ids", None)  # a buffer, no weight
    has_pooler = "bert.pooler.dense.weight" in encoder
    try:
        state = rename_from_hf(encoder, encoder_name_map(config.num_hidden_layers,
                                                         pooler=has_pooler), config)
    except ValueError as error:
        raise ValueError(f"model {source} does not hold a BERT encoder of its config.json's "
                         f"shape: {error}") from None
    return {name: tensor.float() for name, tensor in state.items()}


def _hf_lower_case(source: str, tokenizer_file: TokenizerFile) -> bool:
    """The casing its own tokenizer applies (tokenizer_config.json, else tokenizer.json);
    BERT's default (uncased) where neither says."""
    lower_case = hf_lower_case(source, tokenizer_file)
    return True if lower_case is None else lower_case


def _weights_file_identity(source: str) -> dict[str, Any] | None:
    """A Hugging Face directory's weights file, without reading it: its name and size. What it
    holds (its SHA-256) is read once per command, where a rerun's reuse of runs depends on it
    (`cluster.commands.finetune_sweep.weights_key`), not at every load of the model."""
    path = hf_weights_file(source)
    if path is None:
        return None  # random init from a config and a vocabulary alone
    return {"file": os.path.basename(path), "bytes": os.path.getsize(path)}


def _provenance(source: str, kind: str, random_init: bool, vocab_path: str, *,
                step: int | None, **extra: Any) -> dict[str, Any]:
    return {"source": os.path.abspath(source), "kind": kind, "step": step,
            "vocab_sha256": sha256_file(vocab_path), "random_init": random_init, **extra}
