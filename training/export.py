"""`bertforge export`: any complete checkpoint to a Hugging Face directory."""

from __future__ import annotations

import os

from bertforge.training.checkpoint import load_model, resolve_checkpoint
from bertforge.training.hf_interop import hf_config_dict, to_hf_state_dict, write_hf_directory

# config.json's record of the weights' origin: which checkpoint, run and step they come from.
SOURCE_KEY = "bertforge_source"


def export_checkpoint(checkpoint_or_run_dir: str, output_dir: str) -> str:
    """Write config.json, model.safetensors, vocab and tokenizer files; returns output_dir.

    config.json names the checkpoint, run id and step the weights come from (`SOURCE_KEY`;
    transformers keeps an unknown key as an attribute of the config)."""
    checkpoint_path = resolve_checkpoint(checkpoint_or_run_dir)
    model, metadata = load_model(checkpoint_path)
    source = {"checkpoint": os.path.abspath(checkpoint_path), "run_id": metadata.get("run_id"),
              "global_step": metadata.get("global_step")}
    return write_hf_directory(
        to_hf_state_dict(model.state_dict(), model.config),
        {**hf_config_dict(model.config), SOURCE_KEY: source}, model.config,
        os.path.join(checkpoint_path, "vocab.txt"), metadata["lower_case"], output_dir,
    )
