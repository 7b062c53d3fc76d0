"""`bertforge export`: any complete checkpoint to a Hugging Face directory."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from bertforge.training.checkpoint import (
    load_model,
    positions_trained,
    read_metadata,
    read_newest,
)
from bertforge.training.hf_interop import (
    HF_CONFIG_NAME,
    HF_TOKENIZER_NAME,
    hf_config_dict,
    to_hf_state_dict,
    write_hf_directory,
)

# config.json's record of the weights' origin: which checkpoint, run and step they come from.
SOURCE_KEY = "bertforge_source"


def export_checkpoint(checkpoint_or_run_dir: str, output_dir: str) -> str:
    """Write config.json, model.safetensors, vocab and tokenizer files; returns output_dir.

    config.json names the checkpoint, run id and step the weights come from, and the warm
    start its run grew from, if any (`SOURCE_KEY`;
    transformers keeps an unknown key as an attribute of the config; `exported_source` reads
    it back); the tokenizer's model_max_length is the positions the weights were trained at.
    Everything is read from the checkpoint first (its weights and its vocab.txt), so a train
    still running in the run may remove it afterwards (`read_newest`)."""
    with tempfile.TemporaryDirectory() as scratch:
        vocab_path = os.path.join(scratch, "vocab.txt")

        def read(checkpoint_path: str):
            model, metadata = load_model(checkpoint_path)
            shutil.copyfile(os.path.join(checkpoint_path, "vocab.txt"), vocab_path)
            return model, metadata

        checkpoint_path, (model, metadata) = read_newest(checkpoint_or_run_dir, read)
        # Its lineage too: the checkpoint that gave a warm-started run its first weights (a
        # phase 2's phase-1 checkpoint; None for a run from scratch).
        source = {"checkpoint": os.path.abspath(checkpoint_path),
                  "run_id": metadata.get("run_id"), "global_step": metadata.get("global_step"),
                  "warm_start": metadata.get("warm_start")}
        return write_hf_directory(
            to_hf_state_dict(model.state_dict(), model.config),
            {**hf_config_dict(model.config), SOURCE_KEY: source}, model.config,
            vocab_path, metadata["lower_case"], output_dir,
            # A tokenizer then truncates where the trained positions end (128 after phase 1).
            model_max_length=positions_trained(metadata),
        )


def exported_source(output_dir: str) -> dict:
    """The checkpoint, run id and step an export's weights come from, and its run's warm start
    (its config.json; an export made before it was recorded has no "warm_start")."""
    with open(os.path.join(output_dir, HF_CONFIG_NAME), encoding="utf-8") as f:
        return json.load(f)[SOURCE_KEY]


# What an export writes; each must be there, the weights whole, for it to count as made.
EXPORT_FILES = (HF_CONFIG_NAME, "model.safetensors", "vocab.txt", HF_TOKENIZER_NAME,
                "tokenizer_config.json", "special_tokens_map.json")


def _whole(output_dir: str) -> bool:
    """Every file of an export there, and model.safetensors as long as its header says
    (safetensors refuses one cut short; an export is renamed in whole: only damage from outside
    leaves one short)."""
    from safetensors import SafetensorError, safe_open

    if not all(os.path.isfile(os.path.join(output_dir, name)) for name in EXPORT_FILES):
        return False
    try:
        with safe_open(os.path.join(output_dir, "model.safetensors"), "pt"):
            return True
    except (OSError, SafetensorError):
        return False


def export_already_made(checkpoint_or_run_dir: str, output_dir: str) -> dict | None:
    """The source of the export in `output_dir` when it is of the very checkpoint that
    `checkpoint_or_run_dir` names now (a rerun of a finished export, e.g. one whose process was
    stopped after its last file), else None: a new export, or a refusal, is for the caller.
    The very checkpoint: its path, and the run and step its bertforge.json names (a run
    started again with `--resume never` writes new weights under the same step's path)."""
    try:
        if not _whole(output_dir):
            return None
        source = exported_source(output_dir)
        newest, metadata = read_newest(checkpoint_or_run_dir, read_metadata)
    except (OSError, ValueError, KeyError, TypeError):  # not an export, or no checkpoint
        return None
    same = (os.path.abspath(newest) == os.path.abspath(str(source.get("checkpoint")))
            and metadata.get("run_id") == source.get("run_id")
            and metadata.get("global_step") == source.get("global_step"))
    return source if same else None
