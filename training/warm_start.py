"""Warm start: a fresh run's initial weights from a checkpoint, a run or a Hugging Face directory.

Phase 2 (512 tokens) starts from phase 1's weights, not its state: the optimizer, the schedule
and the loader start anew, as in Google's and NVIDIA's two-phase recipes.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from bertforge.pipelines.contract.manifest import sha256_file
from bertforge.training import checkpoint
from bertforge.training.dataset_facts import DatasetFacts
from bertforge.training.errors import UserInputError
from bertforge.training.hf_interop import (
    HF_CONFIG_NAME,
    HF_WEIGHTS_NAMES,
    OPTIONAL_PARTS,
    hf_positions_trained,
    hf_vocab_file,
    hf_weights_file,
    load_hf_weights,
    pretraining_state_from_any_hf,
    read_hf_config,
)
from bertforge.training.model import BertConfig, BertForPreTraining

# The fields that fix parameter shapes and meaning; dropout and init range may differ.
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "max_position_embeddings", "type_vocab_size", "layer_norm_eps",
)


def load_initial_weights(model: BertForPreTraining, source: str, vocab_sha256: str
                         ) -> InitialWeights:
    """Copy the weights of `source` into `model` after checking architecture and vocabulary;
    the parts the source lacks (`InitialWeights.lacking`) keep the model's own initialisation.
    Returns what was read, less its tensors."""
    initial = read_initial_weights(source)
    check_fits(source, initial.config, initial.vocab_sha256, model.config, vocab_sha256)
    load_weights_into(model, initial, f"init_from {source}")
    return initial._replace(state_dict={})


def load_weights_into(model: BertForPreTraining, initial: InitialWeights, what: str) -> None:
    """`initial`'s tensors into `model`, the parts it lacks left as initialised; a tensor
    missing otherwise, or one the model has no place for, is one error naming `what`."""
    missing, unexpected = model.load_state_dict(initial.state_dict, strict=False)
    fresh = tuple(OPTIONAL_PARTS[part] for part in initial.lacking)
    missing = [name for name in missing if name != "cls.predictions.decoder.weight"  # tied
               and not (fresh and name.startswith(fresh))]
    if missing or unexpected:
        raise UserInputError(
            f"{what} does not fit the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.tie_weights()


def check_fits(source: str, source_config: BertConfig, source_vocab_sha256: str | None,
               target: BertConfig, vocab_sha256: str) -> None:
    """The source's architecture is the model's to train and its vocabulary the data's (when
    it names one): one line naming what differs."""
    check_architecture(source_config, target, source)
    if source_vocab_sha256 is not None and source_vocab_sha256 != vocab_sha256:
        raise UserInputError(
            f"init_from {source} was trained with another vocabulary than the training data "
            f"(vocab sha256 {source_vocab_sha256[:12]} vs {vocab_sha256[:12]})"
        )


class InitialWeights(NamedTuple):
    config: BertConfig
    state_dict: dict[str, torch.Tensor]  # fp32, our names
    vocab_sha256: str | None
    # The longest sequences its pretraining has trained position embeddings for: the rest of
    # max_position_embeddings are still at their random initial values.
    positions_trained: int
    # hf_interop.OPTIONAL_PARTS a Hugging Face BERT of another head lacks (a BertModel: the
    # pretraining heads); a warm start initialises them afresh.
    lacking: tuple[str, ...] = ()
    # What was read, for the run's line: the checkpoint (a run directory's newest, picked at
    # read time) or the Hugging Face directory, and the checkpoint's step and run (None: HF).
    read_from: str = ""
    step: int | None = None
    run_id: str | None = None
    source: str = ""  # the --init-from it was read for

    def record(self) -> dict[str, Any]:
        """What the run records of its warm start (config.json, each checkpoint's
        bertforge.json): the source as given, the checkpoint read (a run directory's newest at
        the time, or the Hugging Face directory) and, for a checkpoint, its step and run."""
        return {"init_from": self.source, "checkpoint": self.read_from,
                "global_step": self.step, "run_id": self.run_id}

    def describe(self) -> str:
        """`RUN/checkpoints/step_00000040 (step 40 of run ID)`, or `DIR (a Hugging Face
        BERT)`."""
        if self.step is None:
            return f"{self.read_from} (a Hugging Face BERT)"
        of_run = f" of run {self.run_id}" if self.run_id else ""
        return f"{self.read_from} (step {self.step}{of_run})"


def read_initial_weights(source: str) -> InitialWeights:
    """The weights of a warm-start source, with what they were trained on."""
    # Checkpoints first: a run directory also holds a config.json (the resolved recipe).
    if checkpoint.holds_checkpoint(source):
        # A run's newest, read before a train still running there may remove it.
        path, (model, metadata) = checkpoint.read_newest(source, checkpoint.load_model)
        return InitialWeights(model.config, model.state_dict(), metadata["vocab_sha256"],
                              checkpoint.positions_trained(metadata), read_from=path,
                              step=metadata.get("global_step"), run_id=metadata.get("run_id"),
                              source=source)
    if hf_weights_file(source) is None:
        raise ValueError(
            f"init_from {source} is neither a complete checkpoint, a run directory with one, "
            f"nor a Hugging Face directory ({HF_CONFIG_NAME} + {HF_WEIGHTS_NAMES[0]})"
        )
    config, vocab_sha256 = hf_source_metadata(source)
    try:
        state, lacking = pretraining_state_from_any_hf(load_hf_weights(source), config)
    except ValueError as error:
        raise UserInputError(f"init_from {source} does not hold a BERT of its "
                             f"{HF_CONFIG_NAME}'s shape: {error}") from None
    return InitialWeights(config, {name: tensor.float() for name, tensor in state.items()},
                          vocab_sha256, hf_positions_trained(source, config), tuple(lacking),
                          read_from=source, source=source)


def hf_source_metadata(source: str) -> tuple[BertConfig, str | None]:
    """A Hugging Face directory's model and its vocabulary's sha256 (None when it has no
    vocabulary), without its weights: what the driver checks before any worker loads them."""
    try:
        config = read_hf_config(source)
        # its vocab.txt, or the WordPiece vocabulary of its tokenizer.json (transformers 5)
        vocab_path = hf_vocab_file(source)
    except ValueError as error:
        raise UserInputError(f"init_from {source}: {error}") from None
    return config, sha256_file(vocab_path) if vocab_path is not None else None


def source_positions(source: str) -> tuple[int, int] | None:
    """(positions trained, max_position_embeddings) of a warm-start source, from its metadata
    alone (a checkpoint's bertforge.json, a Hugging Face directory's config and tokenizer
    files); None when `source` is neither: the run's input checks say what it is."""
    if checkpoint.holds_checkpoint(source):
        _, metadata = checkpoint.read_newest(source, checkpoint.read_metadata)
        config = checkpoint.model_config_of(source, metadata)
        return checkpoint.positions_trained(metadata), config.max_position_embeddings
    if _is_model_config(source):
        try:
            config = read_hf_config(source)
        except ValueError:
            return None
        return hf_positions_trained(source, config), config.max_position_embeddings
    return None


def continued_model(init_from: str | None, run_dir: str, resume: bool) -> dict[str, Any] | None:
    """The model of a `train` that names none (no --preset, no --recipe): a run that resumes
    keeps its checkpoint's (whatever has become of its --init-from since; no flag could name a
    model of its own fields), and a warm start takes its source's, as `from_pretrained` takes a
    model's own. None otherwise, or when the source cannot be read (the run's input checks say
    why): the default preset."""
    if checkpoint.resumes_a_checkpoint(run_dir, resume):
        return source_model_fields(run_dir)
    return source_model_fields(init_from) if init_from else None


def source_model_fields(source: str) -> dict[str, Any] | None:
    """The model a warm-start source holds, read from its metadata alone (a checkpoint's
    bertforge.json, a Hugging Face config.json), as `TrainConfig.model` fields: every
    BertConfig field but vocab_size, which is always the data's. None when `source` is neither:
    the run's input checks say what it is instead."""
    if checkpoint.holds_checkpoint(source):
        _, config = checkpoint.read_newest(source, checkpoint.model_config_of)
    elif _is_model_config(source):
        try:
            config = read_hf_config(source)
        except ValueError as error:
            raise UserInputError(f"init_from {source}: {error}") from None
    else:
        return None
    fields = config.to_dict()
    del fields["vocab_size"]
    return fields


def _is_model_config(source: str) -> bool:
    """`source` has a Hugging Face config.json; a run directory's (a run before its first
    checkpoint) is its recipe, not a model's."""
    return (os.path.exists(os.path.join(source, HF_CONFIG_NAME))
            and not checkpoint.run_marks(source))


def architecture_differences(source: BertConfig, target: BertConfig) -> list[str]:
    """'hidden_size 128 != 256' for every architecture field that differs (source first)."""
    return [
        f"{name} {getattr(source, name)} != {getattr(target, name)}"
        for name in ARCHITECTURE_FIELDS
        if getattr(source, name) != getattr(target, name)
    ]


def check_architecture(source: BertConfig, target: BertConfig, source_name: str) -> None:
    """A clear error naming every architecture field that differs."""
    differences = architecture_differences(source, target)
    if differences:
        vocabulary = (" (the model's vocab_size is its training data's vocabulary's)"
                      if source.vocab_size != target.vocab_size else "")
        raise UserInputError(
            f"init_from {source_name} has another architecture than the model to train "
            f"(source != model: {', '.join(differences)}){vocabulary}; without --preset or "
            "--recipe a warm start trains its source's model"
        )


def check_casing(saved: dict, facts: DatasetFacts, what: str, data_dir: str) -> None:
    """The same vocabulary prepared with the other casing gives its ids other words (an
    upper-case word is [UNK] in an uncased vocabulary): a checkpoint goes on only with data of
    its own casing (`saved`: its bertforge.json, or {"lower_case": None} when unknown)."""
    trained = saved.get("lower_case")
    if trained is None or trained == facts.lower_case:
        return
    casing = {True: "lower-cased", False: "cased"}
    raise UserInputError(
        f"{what} was trained on {casing[trained]} text and {data_dir} is {casing[facts.lower_case]}"
        f" (the same vocabulary, the other casing); prepare the data with "
        f"--{'' if trained else 'no-'}lower-case")


def check_resume_architecture(
    saved: dict, target: BertConfig, checkpoint_path: str, facts: DatasetFacts, data_dir: str
) -> None:
    """A resume loads the checkpoint's shapes: refuse, in one line and before any engine is
    built, data of another vocabulary (`facts`: the data's; checked first, since it also
    changes vocab_size) or casing, or a requested model of another architecture (`saved`: the
    checkpoint's bertforge.json)."""
    vocab_sha256 = facts.vocab_sha256
    if saved.get("vocab_sha256") != vocab_sha256:
        raise UserInputError(
            f"cannot resume {checkpoint_path}: it was trained with another vocabulary than the "
            f"data (vocab sha256 {str(saved.get('vocab_sha256'))[:12]} vs {vocab_sha256[:12]}); "
            "use the run's own dataset, or another --run-dir for a new run"
        )
    differences = architecture_differences(BertConfig.from_dict(saved["model_config"]), target)
    if differences:
        raise UserInputError(
            f"cannot resume {checkpoint_path}: another architecture than the requested model "
            f"(checkpoint != requested: {', '.join(differences)}); name no --preset or "
            "--recipe (a resume then trains the run's own model), or another --run-dir (or "
            "--resume never) for a new run"
        )
    check_casing(saved, facts, f"checkpoint {checkpoint_path}", data_dir)
